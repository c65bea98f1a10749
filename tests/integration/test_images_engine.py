"""A vision-language request in the static engine (worker/backends/static_engine.py), in process: a
request continued after the tokens another worker delivered (a takeover) gives the rest of the
undisturbed reply, its images prefilled again with the prompt; rows with and without images share
a batch; greedy tokens equal transformers' `generate` on the processor's inputs for one image, two,
none, and all in one batch. On a tiny LLaVA-1.5 and a tiny LLaVA-NeXT (the static engine runs a
LLaVA whose language model has no paged runner), a tiny Qwen2-VL and Qwen2.5-VL (M-RoPE) and a
tiny Gemma 3 (an image's tokens attending to each other both ways): the static engine runs those."""
from __future__ import annotations

import pytest
import torch

from shared.messages import RequestPayload
from shared.sampling import SamplingParams
from shared.tokenizer import Tokenizer
from streamq.testing.tiny_vision import FAMILIES, build, png, reference_tokens
from worker.backends.static_engine import BatchRunner, StaticEngine
from worker.engine.vision import size_of

TOKENS = 12


@pytest.fixture(scope="module", params=FAMILIES)
def llava(request, tmp_path_factory):
    return build(request.param, tmp_path_factory.mktemp(request.param))


def _engine(folder) -> tuple[StaticEngine, Tokenizer]:
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    tok = Tokenizer(folder)
    processor = AutoImageProcessor.from_pretrained(folder)
    return StaticEngine(BatchRunner(model, torch.device("cpu"), pad_id=2), tok, 4, processor), tok


def _run(engine: StaticEngine, requests: list[tuple[RequestPayload, list, list[bytes]]]) -> dict[str, list[int]]:
    seqs = [engine.add(payload, resumed, images) for payload, resumed, images in requests]
    while engine.has_work():
        engine.step()
    return {seq.id: list(seq.output_ids) for seq in seqs}


def _payload(rid: str, tok: Tokenizer, images: list[bytes], parts: list | None = None) -> RequestPayload:
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": "Tell me about it."}]
    if parts is not None:
        content = [{"type": "image"} if isinstance(p, bytes) else {"type": "text", "text": p} for p in parts]
    ids = tok.encode_chat([{"role": "user", "content": content}])
    ids = tok.vision.expand(ids, [size_of(image) for image in images])
    return RequestPayload(id=rid, model="m", prompt_token_ids=ids,
                          params=SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))


def test_a_takeover_continues_a_request_with_its_images(llava):
    from shared.messages import TokenEvent

    engine, tok = _engine(llava)
    pictures = [png(1), png(2, (30, 60))]
    whole = _run(engine, [(_payload("a", tok, pictures), [], pictures)])["a"]
    for cut in (1, 5):
        delivered = [TokenEvent(index=i, token_id=t, text=tok.decode([t])) for i, t in enumerate(whole[:cut])]
        rest = _run(engine, [(_payload(f"b{cut}", tok, pictures), delivered, pictures)])[f"b{cut}"]
        assert rest == whole, cut  # the delivered tokens, then exactly the undisturbed rest


def test_rows_with_and_without_images_share_a_batch(llava):
    engine, tok = _engine(llava)
    rows = {rid: [png(n + 3, (40 + 20 * n, 50))] * n for rid, n in (("none", 0), ("one", 1), ("two", 2))}
    alone = {rid: _run(engine, [(_payload(rid, tok, images), [], images)])[rid] for rid, images in rows.items()}
    together = _run(engine, [(_payload(rid, tok, images), [], images) for rid, images in rows.items()])
    assert together == alone
    assert alone["one"] != alone["none"]  # the image changes the reply


CASES = {"one image": [png(1), "What is in the picture?"],
         "two images": ["Compare", png(2, (64, 30)), "with", png(3, (20, 90))],
         "no image": ["Just words, no picture."]}


def test_greedy_tokens_equal_transformers_alone_and_in_one_batch(llava):
    engine, tok = _engine(llava)
    want = {name: reference_tokens(llava, parts, TOKENS, ignore_eos=True) for name, parts in CASES.items()}

    def request(rid: str, parts: list):
        images = [p for p in parts if isinstance(p, bytes)]
        return _payload(rid, tok, images, parts), [], images

    for name, parts in CASES.items():
        assert _run(engine, [request(name, parts)])[name] == want[name], name
    assert _run(engine, [request(name, parts) for name, parts in CASES.items()]) == want


def test_the_prefill_logits_equal_transformers_on_the_processor_inputs(llava):
    """Each row's last logits of a left-padded batch equal the model's forward on its processor's
    inputs alone, within 1e-4: the positions (M-RoPE's included) and the masks (Gemma 3's two-way
    attention within an image, which moves them by far more) as the model's own."""
    import io

    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from streamq.testing.tiny_vision import processor_inputs
    from worker.engine.vision import processor_inputs as worker_inputs

    model = AutoModelForImageTextToText.from_pretrained(llava, dtype=torch.float32).eval()
    tok = Tokenizer(llava)
    rows = [[png(1), "What is in the picture?"], ["Compare", png(2, (64, 30)), "with", png(3, (20, 90)), "now"]]
    want = []
    for parts in rows:
        content = [{"type": "image"} if isinstance(p, bytes) else {"type": "text", "text": p} for p in parts]
        pictures = [Image.open(io.BytesIO(p)).convert("RGB") for p in parts if isinstance(p, bytes)]
        with torch.no_grad():
            want.append(model(**processor_inputs(llava, [{"role": "user", "content": content}], pictures)).logits[0, -1])
    runner = BatchRunner(model, torch.device("cpu"), pad_id=2)
    blobs = [p for parts in rows for p in parts if isinstance(p, bytes)]
    images = worker_inputs(AutoImageProcessor.from_pretrained(llava), blobs, torch.device("cpu"), torch.float32)
    ids = [_payload(str(i), tok, [p for p in parts if isinstance(p, bytes)], parts).prompt_token_ids
           for i, parts in enumerate(rows)]
    got = runner.prefill(ids, images)
    for row, expected in enumerate(want):
        assert torch.allclose(got[row], expected, atol=1e-4), (row, (got[row] - expected).abs().max())
