"""LoRA adapters in the paged engine, in-process on the tiny llama model in fp32: ONE batch mixing
requests of several adapters and of the base model gives each request the greedy tokens of peft's
merged model of its adapter, on every path the runner takes for llama-family models."""
from __future__ import annotations

import pytest
import torch

from shared.messages import FinishReason, RequestPayload
from shared.sampling import SamplingParams
from shared.tokenizer import Tokenizer
from streamq.testing.lora_adapters import make_adapter, merged_greedy
from worker.model import kernels
from worker.engine.batcher import Batcher
from worker.engine.block_manager import BlockManager
from worker.engine.core import Engine
from worker.model.lora import Adapters
from worker.model.model_loader import load_model
from worker.model.model_runner import PagedRunner
from worker.engine.speculation import NgramProposer, Speculator

CPU = torch.device("cpu")
NEW = 12
TEXTS = ["the capital of France is Paris and once upon a time", "streams, batches and caches: a worker runs",
         "안녕하세요, 반갑습니다 café", "once upon a time there was a small model"]
# (name, rank, targets, options): different ranks and targets, one on all seven projections, one rsLoRA.
ADAPTERS = [("qv", 4, ["q_proj", "v_proj"], {}), ("all", 8, None, {}),
            ("mlp", 2, ["gate_proj", "down_proj", "o_proj"], {"use_rslora": True}), ("kup", 16, ["k_proj", "up_proj"], {})]


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {name: make_adapter(tiny_llama, root / name, r=r, modules=targets, seed=i + 1, **options)
            for i, (name, r, targets, options) in enumerate(ADAPTERS)}


@pytest.fixture(scope="module")
def references(tiny_llama, adapters):
    tokenizer = Tokenizer(tiny_llama)
    return {(name, text): merged_greedy(tiny_llama, adapters.get(name), tokenizer.encode(text), NEW)
            for name in [None, *adapters] for text in TEXTS}


def engine(folder, adapters: dict, path: str, speculate: bool = False) -> Engine:
    model = load_model(folder, CPU, torch.float32)
    ops = kernels.load() if path in ("kernels", "portable") else None
    if path == "portable":
        ops = kernels.with_isa(ops, "portable")  # the kernels' layers, the projections on oneDNN (no panels)
    runner = PagedRunner(model, CPU, 256, 4, ops, fuse=path != "eager")  # eager: the modules' own projections
    runner.adapters = Adapters(model, 8, 16, known=adapters, kernels=runner.kernels)
    speculator = Speculator(NgramProposer(4, 1, 3), 4) if speculate else None
    return Engine(runner, Tokenizer(folder), Batcher(BlockManager(256, 4), 24, 512), speculator)


def run(engine: Engine, requests: list[tuple[str | None, str]]) -> list:
    """Every request added before the first step: they run in one batch."""
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    seqs = [engine.add(RequestPayload(id=f"r{i}", model="m", prompt_token_ids=engine.tokenizer.encode(text),
                                      params=params, adapter=name))
            for i, (name, text) in enumerate(requests)]
    engine.step()
    assert len(engine.running) == sum(not s.finished for s in seqs)  # all admitted in the first step
    while engine.has_work():
        engine.step()
    return seqs


MIX = [(name, text) for text in TEXTS for name in [None, "qv", "all", "mlp", "kup"]]


@pytest.mark.parametrize("path", ["kernels", "portable", "fused", "eager"])
def test_one_batch_of_several_adapters_and_the_base_gives_each_its_merged_models_tokens(
        tiny_llama, adapters, references, path):
    runner_engine = engine(tiny_llama, adapters, path)
    seqs = run(runner_engine, MIX)
    assert all(s.error is None for s in seqs)
    assert [s.output_ids for s in seqs] == [references[request] for request in MIX]
    # The same prompt under different adapters never shares prefix-cache blocks; under one it does.
    differs = {text: len({tuple(references[(n, text)]) for n in [None, *adapters]}) for text in TEXTS}
    assert all(count > 2 for count in differs.values())


def test_prefix_cache_blocks_are_shared_within_an_adapter_only(tiny_llama, adapters, references):
    e = engine(tiny_llama, adapters, "kernels")
    text = TEXTS[0]
    first = run(e, [("all", text)])
    hits = e.batcher.blocks.prefix_hits
    again = run(e, [("qv", text), (None, text)])  # cached under "all" only: nothing to reuse
    assert e.batcher.blocks.prefix_hits == hits
    same = run(e, [("all", text)])
    assert e.batcher.blocks.prefix_hits > hits and same[0].reused_tokens > 0
    assert [s.output_ids for s in first + again + same] == [references[(n, text)] for n in ("all", "qv", None, "all")]


def test_one_token_steps_of_an_adapter_leave_the_one_call_stack(tiny_llama, adapters, references):
    e = engine(tiny_llama, adapters, "kernels")
    assert e.runner.one_token is not None or kernels.load() is None
    for name in ("kup", None):  # alone: every decode step has one token
        assert run(e, [(name, TEXTS[1])])[0].output_ids == references[(name, TEXTS[1])]


def test_speculation_with_adapters_keeps_each_adapters_tokens(tiny_llama, adapters, references):
    e = engine(tiny_llama, adapters, "kernels", speculate=True)
    seqs = run(e, MIX)
    assert [s.output_ids for s in seqs] == [references[request] for request in MIX]
    assert e.speculator.stats.drafts > 0


def test_an_unknown_adapter_ends_its_request_alone(tiny_llama, adapters, references):
    e = engine(tiny_llama, adapters, "kernels")
    bad, good = run(e, [("missing", TEXTS[0]), ("all", TEXTS[0])])
    assert bad.finish_reason is FinishReason.ERROR and "'missing'" in bad.error
    assert good.error is None and good.output_ids == references[("all", TEXTS[0])]
    plain = PagedRunner(load_model(tiny_llama, CPU, torch.float32), CPU, 64, 4, None)
    no_lora = Engine(plain, Tokenizer(tiny_llama), Batcher(BlockManager(64, 4), 4, 64))
    (seq,) = run(no_lora, [("all", TEXTS[0])])
    assert seq.finish_reason is FinishReason.ERROR and "serves no LoRA adapters" in seq.error


def test_base_requests_beside_adapter_rows_keep_the_base_runners_logprobs(tiny_llama, adapters):
    """A base row gets no delta: its logprobs beside adapter rows are those of a runner with no
    adapters at all, bit for bit, so the base model stays batch-invariant (PagedRunner.batch_invariant)."""
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=2)

    def base_logprobs(e: Engine, mixed: bool) -> list:
        ids = e.tokenizer.encode(TEXTS[1])
        extra = [("all", TEXTS[0]), ("qv", TEXTS[2]), ("mlp", TEXTS[1])] if mixed else []
        base, *_ = e.generate([RequestPayload(id="base", model="m", prompt_token_ids=ids, params=params)] + [
            RequestPayload(id=f"x{i}", model="m", prompt_token_ids=e.tokenizer.encode(text), params=params,
                           adapter=name) for i, (name, text) in enumerate(extra)])
        assert base.error is None
        return [(t.token_id, t.logprob, t.top_logprobs) for t in base.tokens]

    with_adapters = engine(tiny_llama, adapters, "kernels")
    plain = PagedRunner(load_model(tiny_llama, CPU, torch.float32), CPU, 256, 4, kernels.load())
    alone = Engine(plain, Tokenizer(tiny_llama), Batcher(BlockManager(256, 4), 24, 512))
    assert base_logprobs(with_adapters, mixed=True) == base_logprobs(alone, mixed=False)
    assert with_adapters.runner.batch_invariant == plain.batch_invariant
