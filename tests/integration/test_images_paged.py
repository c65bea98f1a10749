"""A vision-language model in the paged engine (worker/engine/vision.py), in process, on a tiny
LLaVA-1.5, LLaVA-NeXT (anyres tiles: each image's tokens by its size), Qwen2-VL and Qwen2.5-VL
(M-RoPE) and Gemma 3 (an image's tokens attending to each other both ways): the vision tower runs inside the engine's step, its embeddings in the image tokens'
rows. Greedy tokens equal transformers' `generate` on the processor's inputs, for one image, two,
none, and all of them in one batch, on each forward (the CPU step kernels, their portable ISA,
the fused eager ops, the modules' own); a prompt chunked by a small token budget never splits an
image; a second turn with the same image reuses the first turn's blocks (the image's included)
and runs no tower, another picture with the same words reuses nothing from the image on, and
another tenant reuses neither blocks nor embeddings."""
from __future__ import annotations

import pytest
import torch

from shared.messages import RequestPayload
from shared.sampling import SamplingParams
from shared.tokenizer import Tokenizer
from streamq.testing.tiny_vision import FAMILIES, build, png, reference_tokens
from worker.engine.batcher import Batcher
from worker.engine.block_manager import BlockManager
from worker.engine.core import Engine
from worker.engine.vision import ImageEncoder, TextView, size_of
from worker.model import kernels
from worker.model.model_runner import PagedRunner

CPU = torch.device("cpu")
TOKENS = 10
BLOCK = 4
PATHS = ["kernels", "portable", "fused", "eager"]


@pytest.fixture(scope="module", params=FAMILIES)
def llava(request, tmp_path_factory):
    return build(request.param, tmp_path_factory.mktemp(request.param))


def _engine(folder, path: str = "fused", budget: int = 512) -> Engine:
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    tok = Tokenizer(folder)
    ops = kernels.load() if path in ("kernels", "portable") else None
    if path == "portable":
        ops = kernels.with_isa(ops, "portable")
    runner = PagedRunner(TextView(model), CPU, 128, BLOCK, ops, fuse=path != "eager")
    encoder = ImageEncoder(model, AutoImageProcessor.from_pretrained(folder), tok.vision)
    return Engine(runner, tok, Batcher(BlockManager(128, BLOCK), min(8, budget), budget), images=encoder)


def _parts_ids(tok: Tokenizer, parts: list) -> list[int]:
    content = [{"type": "image"} if isinstance(p, bytes) else {"type": "text", "text": p} for p in parts]
    return tok.vision.expand(tok.encode_chat([{"role": "user", "content": content}]),
                             [size_of(p) for p in parts if isinstance(p, bytes)])


def _payload(rid: str, ids: list[int], tenant: str = "t") -> RequestPayload:
    return RequestPayload(id=rid, model="m", prompt_token_ids=ids, tenant=tenant,
                          params=SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))


def _run(engine: Engine, requests: list[tuple[str, list, str]]) -> dict[str, list[int]]:
    """(id, parts, tenant) each, all added before the first step: one batch."""
    seqs = [engine.add(_payload(rid, _parts_ids(engine.tokenizer, parts), tenant), (),
                       [p for p in parts if isinstance(p, bytes)]) for rid, parts, tenant in requests]
    while engine.has_work():
        for out in engine.step():
            assert out.end is None or out.end.error is None, out.end.error
    return {seq.id: list(seq.output_ids) for seq in seqs}


CASES = {"one image": [png(1), "What is in the picture?"],
         "two images": ["Compare", png(2, (64, 30)), "with", png(3, (20, 90))],
         "no image": ["Just words, no picture."]}


@pytest.fixture(scope="module")
def references(llava):
    return {name: reference_tokens(llava, parts, TOKENS, ignore_eos=True) for name, parts in CASES.items()}


@pytest.mark.parametrize("path", PATHS)
def test_greedy_tokens_equal_transformers_alone_and_in_one_batch(llava, references, path):
    if path == "eager" and "gemma3" in llava.name:
        pytest.skip("Gemma 3 runs on its fused forward only (worker/model/forwards/gemma.py)")
    engine = _engine(llava, path)
    for name, parts in CASES.items():
        assert _run(engine, [(name, parts, "t")])[name] == references[name], name
    together = _run(engine, [(f"b-{name}", parts, "t") for name, parts in CASES.items()])
    assert together == {f"b-{name}": references[name] for name in CASES}


def test_a_small_token_budget_chunks_the_prompt_but_never_an_image(llava, references):
    engine = _engine(llava, budget=6)  # 4 tokens an image or more; chunks of 6 tokens would cut some
    cuts = []
    step = engine.runner.execute

    def noting(out, hidden=False, images=None):
        for chunk in out.chunks:
            if chunk.seq.vision is not None:
                for start, length in chunk.seq.vision.spans:
                    cuts.append(chunk.start < start + length and start < chunk.start + chunk.length and
                                not (chunk.start <= start and start + length <= chunk.start + chunk.length))
        return step(out, hidden, images)
    engine.runner.execute = noting
    got = _run(engine, [(name, parts, "t") for name, parts in CASES.items()])
    assert got == references and cuts and not any(cuts)


def test_a_second_turn_with_the_same_image_reuses_its_blocks_and_embeddings(llava):
    engine = _engine(llava)
    picture, other = png(7), png(8)
    long_words = "Describe the picture in detail, " * 3
    first = [picture, long_words]
    _run(engine, [("first", first, "a")])
    encoded = engine.images.images_encoded
    assert encoded == 1

    def reused(rid: str, parts: list, tenant: str) -> int:
        seq = engine.add(_payload(rid, _parts_ids(engine.tokenizer, parts), tenant), (),
                         [p for p in parts if isinstance(p, bytes)])
        while engine.has_work():
            engine.step()
        return seq.reused_tokens

    ids = _parts_ids(engine.tokenizer, first)
    image_end = max(i for i, t in enumerate(ids) if t == engine.tokenizer.vision.image_token_id) + 1
    again = reused("again", first + ["And the colours?"], "a")
    assert again >= image_end and engine.images.images_encoded == encoded  # the image's blocks; no tower run
    image_start = ids.index(engine.tokenizer.vision.image_token_id)
    assert reused("other picture", [other, long_words], "a") <= image_start  # nothing from the image on
    assert engine.images.images_encoded == encoded + 1
    assert reused("other tenant", first, "b") == 0 and engine.images.images_encoded == encoded + 2


def test_a_request_whose_images_do_not_match_its_image_tokens_fails_alone(llava, references):
    engine = _engine(llava)
    tok = engine.tokenizer
    ids = _parts_ids(tok, CASES["one image"])
    engine.add(_payload("bad", ids), (), [png(1), png(2)])  # two images, one run of image tokens
    good = engine.add(_payload("good", _parts_ids(tok, CASES["one image"])), (), [png(1)])
    errors = {}
    while engine.has_work():
        for out in engine.step():
            if out.end is not None and out.end.error:
                errors[out.request_id] = out.end.error
    assert set(errors) == {"bad"} and "image" in errors["bad"]
    assert list(good.output_ids) == references["one image"]


@pytest.mark.parametrize("path", PATHS)
def test_the_prefill_logits_equal_transformers_on_the_processor_inputs(llava, path):
    """The last logits of a prompt with two images equal the model's forward on its processor's
    inputs within 1e-4, in fp32 on each forward: M-RoPE's positions and Gemma 3's two-way attention
    within an image (its sliding window still ending at each token) as the model's own, which
    greedy tokens alone may not show (the test fails without the two-way attention)."""
    import io

    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from streamq.testing.tiny_vision import processor_inputs

    if path == "eager" and "gemma3" in llava.name:
        pytest.skip("Gemma 3 runs on its fused forward only (worker/model/forwards/gemma.py)")
    parts = CASES["two images"]
    content = [{"type": "image"} if isinstance(p, bytes) else {"type": "text", "text": p} for p in parts]
    pictures = [Image.open(io.BytesIO(p)).convert("RGB") for p in parts if isinstance(p, bytes)]
    model = AutoModelForImageTextToText.from_pretrained(llava, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(**processor_inputs(llava, [{"role": "user", "content": content}], pictures)).logits[0, -1]
    engine = _engine(llava, path)
    seen = []
    step = engine.runner.execute

    def keeping(out, hidden=False, images=None):
        logits = step(out, hidden, images)
        seen.append(logits)
        return logits
    engine.runner.execute = keeping
    _run(engine, [("two", parts, "t")])
    assert torch.allclose(seen[0][0], want, atol=1e-4), (seen[0][0] - want).abs().max()
