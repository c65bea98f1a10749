"""Each token computed alone, on the tiny llama: a request's tokens and their log-probabilities,
bit for bit, are the same alone or in a batch of 32 others at any position, with its prefill
chunked at any budget, with a prefix-cache hit or a miss, with prompt-lookup or draft speculation
on or off, and continued from delivered tokens as after a failover. Greedy and seeded sampling
alike.

It holds by default (no mode) where every projection computes each row alone (the kernels'
panels for the dtype, or the quantized kernels): fp32 on any CPU with AVX2, bf16 with
AVX512-BF16 but no AMX. Deterministic mode (PagedRunner(deterministic=True)) makes it hold
elsewhere too: here in bf16, and in fp32 with the panels taken away as on a CPU without them (the
library's matmul, in fixed tiles in the mode). Without the mode and without panels the
comparisons fail (docs/reliability.md).
"""
from __future__ import annotations

import pytest
import torch

from shared.messages import RequestPayload, TokenEvent
from shared.sampling import SamplingParams
from shared.tokenizer import Tokenizer
from streamq.testing.tiny_models import build_model
from worker.model import kernels
from worker.engine.batcher import Batcher
from worker.engine.block_manager import BlockManager
from worker.engine.drafter import DraftProposer
from worker.engine.core import Engine
from worker.model.model_loader import load_model
from worker.model.model_runner import PagedRunner
from worker.engine.speculation import NgramProposer, Speculator

CPU = torch.device("cpu")
NEW_TOKENS = 24
SAMPLINGS = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.9, "seed": 5}}
# Deterministic mode in bf16 and in fp32 with the panels taken away (fixed tiles); the default in
# fp32 and bf16, where this CPU has panels for the dtype (skipped where it has not).
ENGINES = {"bf16": {}, "fp32 without panels": {"dtype": torch.float32, "panels": False},
           "default bf16": {"deterministic": False}, "default fp32": {"deterministic": False, "dtype": torch.float32}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("tiny-llama-det"), "llama", seed=3)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("tiny-llama-det-draft"), "llama", seed=4)


class WithoutPanels:
    """The step kernels as on a CPU without panel_linear for any dtype (AVX2 only): the
    projections run on the library's matmul, in fixed tiles in deterministic mode."""

    panel_dtypes = ()

    def __getattr__(self, name):
        return getattr(kernels.load(), name)


def make(folder, budget: int = 2048, prefix: bool = True, deterministic: bool = True, batch: int = 40,
         dtype: torch.dtype = torch.bfloat16, panels: bool = True, blocks: int = 1024) -> Engine:
    model = load_model(folder, CPU, dtype)
    return engine_on(model, Tokenizer(folder), budget, prefix, deterministic, batch, kernels.load() if panels
                     else WithoutPanels(), blocks)


def engine_on(model, tokenizer: Tokenizer, budget: int = 2048, prefix: bool = True, deterministic: bool = True,
              batch: int = 40, ops=None, blocks: int = 1024) -> Engine:
    runner = PagedRunner(model, CPU, blocks, 4, ops or kernels.load(), deterministic=deterministic)
    if not runner.batch_invariant:  # only where the default computes each token alone does it promise so
        pytest.skip(f"no panels for {runner.k_cache.dtype} on this CPU, or its calls of many rows go to "
                    f"oneDNN (AMX): exact only in deterministic mode")
    return Engine(runner, tokenizer, Batcher(BlockManager(blocks, 4, prefix), batch, budget))


def prompts(tok: Tokenizer, n: int) -> list[list[int]]:
    words = "the capital of France is Paris and streams batches caches once upon a time".split()
    return [tok.encode(" ".join(words[(i * 3 + j) % len(words)] for j in range(6 + (i * 7) % 40)))
            for i in range(n)]


def run(engine: Engine, prompt_ids: list[list[int]], sampling: dict, every: int = 0) -> list[list[tuple]]:
    """Each request's (token, logprob) pairs; `every` > 0 adds one request every that many steps."""
    out: dict[str, list[tuple]] = {}
    pending = list(enumerate(prompt_ids))
    steps = 0
    while pending or engine.has_work():
        while pending and (every == 0 or steps % every == 0):
            i, ids = pending.pop(0)
            params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, **sampling)
            engine.add(RequestPayload(id=f"r{i}", model="m", prompt_token_ids=ids, params=params))
            out[f"r{i}"] = []
            if every:
                break
        for step in engine.step():
            if step.token is not None:
                out[step.request_id].append((step.token.token_id, step.token.logprob))
        steps += 1
    return [out[f"r{i}"] for i in range(len(prompt_ids))]


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
@pytest.mark.parametrize("options", ENGINES.values(), ids=ENGINES.keys())
def test_alone_or_in_a_batch_of_32_at_any_position(model_dir, sampling, options):
    others = prompts(make(model_dir).tokenizer, 33)
    mine = others.pop(max(range(33), key=lambda i: len(others[i])))  # a long prompt: a prefill over 32 tokens
    alone = run(make(model_dir, **options), [mine], sampling)[0]
    assert len(alone) == NEW_TOKENS
    for position in (0, 17, 32):
        batch = others[:position] + [mine] + others[position:]
        assert run(make(model_dir, **options), batch, sampling)[position] == alone, position




@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
@pytest.mark.parametrize("options", ENGINES.values(), ids=ENGINES.keys())
def test_prefill_chunked_at_any_budget(model_dir, sampling, options):
    """Also without panels (forced here, as an AVX2-only CPU has none): a step whose chunks need no
    logits projects zero rows through the fixed tiles."""
    batch = prompts(make(model_dir).tokenizer, 6)
    whole = run(make(model_dir, **options), batch, sampling)
    for budget in (7, 16, 50):
        assert run(make(model_dir, budget=budget, batch=6, **options), batch, sampling) == whole, budget


@pytest.mark.parametrize("options", ENGINES.values(), ids=ENGINES.keys())
def test_a_prefix_cache_hit_or_miss(model_dir, options):
    tok = make(model_dir).tokenizer
    shared = prompts(tok, 40)[39]  # the longest
    first, second = shared + tok.encode(" one"), shared + tok.encode(" two")
    engine = make(model_dir, **options)
    run(engine, [first], SAMPLINGS["greedy"])
    hit = run(engine, [second], SAMPLINGS["greedy"])[0]  # its prefix's blocks are cached now
    assert engine.batcher.blocks.prefix_hits > 0
    miss = run(make(model_dir, prefix=False, **options), [second], SAMPLINGS["greedy"])[0]
    assert hit == miss


@pytest.mark.parametrize("method", ["ngram", "draft"])
@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
@pytest.mark.parametrize("options", ENGINES.values(), ids=ENGINES.keys())
def test_speculation_on_or_off(model_dir, draft_dir, method, sampling, options):
    """A verify scores 1 + k tokens in one chunk where plain decoding scores one: without panels,
    the library's matmul gives a row alone another result than among others (fp32 here), and
    without the mode the outputs part (3 of these 4 cases; a draft proposes nothing to a seeded
    request in the mode). With panels the default computes each row alone already."""
    # One stream, repeating itself (for lookup to propose): plain, it decodes one row a step.
    batch = [ids * 3 for ids in prompts(make(model_dir).tokenizer, 5)][3:4]
    plain = run(make(model_dir, **options), batch, sampling)
    engine = make(model_dir, **options)
    if method == "ngram":
        engine.speculator = Speculator(NgramProposer(4, 1, 3), 4)
    else:
        draft = load_model(draft_dir, CPU, options.get("dtype", torch.bfloat16))
        # Without the mode too, a draft's proposals to a seeded request are accepted by rejection
        # sampling, which draws in another order than plain sampling (the same distribution, not
        # the same tokens): the worker lets a draft propose to sampled requests outside the mode.
        engine.speculator = Speculator(DraftProposer.beside(engine.runner, draft), 3, draft_sampled=False)
    assert run(engine, batch, sampling) == plain
    if method == "ngram" or sampling is SAMPLINGS["greedy"]:
        assert engine.speculator.stats.proposed > 0


@pytest.mark.parametrize("options", ENGINES.values(), ids=ENGINES.keys())
def test_requests_arriving_while_others_decode(model_dir, options):
    """Staggered arrivals: a request's prefill shares steps with others' decodes."""
    batch = prompts(make(model_dir).tokenizer, 8)
    together = run(make(model_dir, **options), batch, SAMPLINGS["seeded"])
    assert run(make(model_dir, **options), batch, SAMPLINGS["seeded"], every=3) == together


def test_the_mode_needs_the_cpu_step_kernels(model_dir):
    model = load_model(model_dir, CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="CPU step kernels"):
        PagedRunner(model, CPU, 64, 4, None, deterministic=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_without_panel_linear_the_projections_run_in_fixed_tiles(model_dir, dtype):
    """As on an AVX2-only CPU: the library's matmul, whose result for a row depends on how many
    rows share the call (fp32 here), runs in calls of 16 rows, so the batch does not matter."""
    others = prompts(make(model_dir).tokenizer, 20)
    mine = others.pop(max(range(20), key=lambda i: len(others[i])))
    alone = run(make(model_dir, dtype=dtype, panels=False), [mine], SAMPLINGS["greedy"])[0]
    engine = make(model_dir, dtype=dtype, panels=False)
    assert engine.runner.lm_head.tile and engine.runner.one_token is None
    assert run(engine, others[:7] + [mine] + others[7:], SAMPLINGS["greedy"])[7] == alone


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
@pytest.mark.parametrize("options", ENGINES.values(), ids=ENGINES.keys())
def test_a_continuation_from_delivered_tokens_is_the_undisturbed_run(model_dir, sampling, options):
    """As after a failover: the prompt and the k tokens delivered are prefilled in one chunk (the
    undisturbed run decoded them one at a time, among others), and a seeded request's random
    stream is moved past its k draws."""
    batch = prompts(make(model_dir).tokenizer, 6)
    undisturbed = run(make(model_dir, **options), batch, sampling)
    for k in (1, 9):
        params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, **sampling)
        delivered = [[TokenEvent(index=j, token_id=t, text="") for j, (t, _) in enumerate(tokens[:k])]
                     for tokens in undisturbed]
        seqs = make(model_dir, **options).generate(batch, params, resumed=delivered)
        assert [s.output_ids for s in seqs] == [[t for t, _ in tokens] for tokens in undisturbed], k


@pytest.mark.slow
@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
@pytest.mark.parametrize("served", ["deterministic", "as served"])
def test_the_whole_set_on_the_default_model(sampling, served):
    """SmolLM2-135M in the dtype `auto` serves it in on this CPU, W's chat prompts: one request
    alone, in W's batch of 32, with its prefill chunked, after a prefix-cache hit, with prompt
    lookup, and continued after 9 tokens.
    - deterministic: its float weights (the GGUF dequantized) in the mode (bf16 with panel_linear
      where the CPU computes bf16, fp32 on the library's matmul in fixed tiles on an AVX2-only one;
      the tiny-model tests above run both paths on every CPU);
    - as served: what `make run` serves, with no mode: the GGUF kept quantized, on the quantized
      kernels of this CPU's ISA (int8 activations with AVX-512 VNNI). Skipped where the default
      does not compute each token alone (bf16 on a CPU with AMX).
    (bf16 on an AVX2-only CPU, which `auto` never picks, took five minutes a case: every bf16
    product is converted there.)"""
    import json
    from pathlib import Path

    from shared.model_paths import prepare_model, weights_dir
    from shared.settings import WorkerSettings
    from worker.model.model_loader import load_weights, pick_dtype

    settings = WorkerSettings(_env_file=None, model="default")
    prepare_model(settings)
    folder = weights_dir(settings)
    dtype = pick_dtype("auto", CPU)
    tok = Tokenizer(folder)

    def engine(**options) -> Engine:
        if served == "deterministic":
            return make(folder, blocks=4096, dtype=dtype, **options)
        model = load_weights(settings, CPU, dtype)
        return engine_on(model, tok, deterministic=False, ops=kernels.load(settings.step), blocks=4096, **options)
    workload = json.loads((Path(__file__).parents[2] / "benchmarks" / "workload_w.json").read_text())
    w = [tok.encode_chat(m) for m in workload["messages"]]
    mine = w.pop(17)
    alone = run(engine(), [mine], sampling)[0]
    assert run(engine(), w[:17] + [mine] + w[17:], sampling)[17] == alone
    assert run(engine(budget=40, batch=8), w[:7] + [mine], sampling)[7] == alone
    cached = engine()
    run(cached, [mine[:-3]], sampling)  # the same chat but its last tokens: its blocks are cached
    assert run(cached, [mine], sampling)[0] == alone and cached.batcher.blocks.prefix_hits > 0
    lookup = engine()
    lookup.speculator = Speculator(NgramProposer(4, 1, 3), 4)
    assert run(lookup, [mine], sampling)[0] == alone
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0, **sampling)
    delivered = [TokenEvent(index=j, token_id=t, text="") for j, (t, _) in enumerate(alone[:9])]
    [seq] = engine().generate([mine], params, resumed=[delivered])
    assert seq.output_ids == [t for t, _ in alone]
