"""Models served with quantized weights: a GGUF file's blocks kept quantized and a float folder
compressed at load (STREAMQ_QUANTIZATION) decode as their dequantized float twins do, hold no
float copy of a quantized weight, and keep prefix caching, speculation and deterministic mode."""
from __future__ import annotations

import json

import pytest
import torch

from shared.messages import RequestPayload
from shared.sampling import SamplingParams
from shared.settings import WorkerSettings
from shared.tokenizer import Tokenizer
from streamq.testing.tiny_models import build_model, write_tiny_gguf
from tests.unit.test_engine import NEW_TOKENS, prompts, run
from worker.model import kernels, quant_model
from worker.engine.batcher import Batcher
from worker.engine.block_manager import BlockManager
from worker.engine.core import Engine
from worker.model.model_loader import load_model, load_weights
from worker.model.model_runner import PagedRunner
from worker.engine.speculation import NgramProposer, Speculator

CPU = torch.device("cpu")
# The widest kernels this CPU has with fp32 activations, and the path any CPU runs: a float twin
# decodes alike on both. (AVX-512 VNNI's int8 activations have their own test below.)
FP32 = "fp32"
ISAS = [FP32, "portable"]


def engine_of(model, folder, isa: str = "auto", prefix: bool = True, budget: int = 32) -> Engine:
    held = kernels.with_isa(kernels.load(), kernels.widest_fp32(kernels.load()) if isa == FP32 else isa)
    runner = PagedRunner(model, CPU, 256, 4, held)
    return Engine(runner, Tokenizer(folder), Batcher(BlockManager(256, 4, prefix), 8, budget))


def float_twin(folder, method: str):
    """The model with every projection (and the head) replaced by its compressed values, in float."""
    model = load_model(folder, CPU, torch.float32)
    quant_model.compress(model, method)
    for module in model.modules():
        if quant_model.quantized(module) is not None:
            module.weight = torch.nn.Parameter(module.quantized.dequantize(), requires_grad=False)
            del module.quantized
    return model


def compressed(folder, method: str, tmp_path):
    settings = WorkerSettings(_env_file=None, model=str(folder), quantization=method, model_cache_dir=tmp_path)
    return load_weights(settings, CPU, torch.float32)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_compressed_model_decodes_as_its_float_twin(tiny_llama, tmp_path, method, isa):
    texts = prompts(6, seed=3)
    want = [s.output_ids for s in run(engine_of(float_twin(tiny_llama, method), tiny_llama, isa), texts)]
    model = compressed(tiny_llama, method, tmp_path)
    engine = engine_of(model, tiny_llama, isa)
    # No float copy of a quantized weight is left: the modules hold empty placeholders.
    for layer in model.model.layers:
        assert len(quant_model.projections(layer)) == 7
        assert all(module.weight.numel() == 0 for module in quant_model.projections(layer))
    assert model.lm_head.weight.numel() == 0
    assert [s.output_ids for s in run(engine, texts)] == want


def test_phi3_compressed_decodes_as_its_float_twin(tmp_path):
    """Phi-3's fused qkv_proj and gate_up_proj modules are compressed, and run, as one projection each."""
    folder = build_model(tmp_path / "phi3", "phi3")
    texts = prompts(6, seed=3)
    want = [s.output_ids for s in run(engine_of(float_twin(folder, "int8"), folder, FP32), texts)]
    model = compressed(folder, "int8", tmp_path / "cache")
    for layer in model.model.layers:
        assert [type(m.quantized).__name__ for m in quant_model.projections(layer)] == ["QuantizedWeight"] * 4
    assert quant_model.quantized(model.model.layers[0].self_attn.qkv_proj).shape == (4 * 16 + 2 * 2 * 16, 64)
    assert [s.output_ids for s in run(engine_of(model, folder, FP32), texts)] == want


@pytest.mark.parametrize("isa", ISAS)
def test_gemma3_compressed_decodes_as_its_float_twin(tmp_path, isa):
    """Gemma 3's projections and tied head kept quantized on the fused Weights, its own norms,
    q/k norms and GELU around them; past its 13-position window, on the kernels and portably."""
    folder = build_model(tmp_path / "gemma3", "gemma3")
    texts = prompts(6, seed=3)
    want = [s.output_ids for s in run(engine_of(float_twin(folder, "int8"), folder, isa), texts)]
    model = compressed(folder, "int8", tmp_path / "cache")
    assert quant_model.quantized(model.model.embed_tokens) is quant_model.quantized(model.lm_head) is not None
    engine = engine_of(model, folder, isa)
    assert engine.runner.fused is not None and engine.runner.lm_head.quant is not None
    assert isinstance(model.model.embed_tokens, quant_model.QuantizedEmbedding)  # scaled by sqrt(hidden) there
    assert [s.output_ids for s in run(engine, texts)] == want


def greedy_events(engine: Engine, texts: list[str]) -> dict[str, list]:
    """Each request's token events, greedy, with the two most likely tokens' logprobs."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=2)
    payloads = [RequestPayload(id=f"r{i}", model="m", prompt_token_ids=engine.tokenizer.encode(text), params=params)
                for i, text in enumerate(texts)]
    return {g.request_id: g.tokens for g in engine.generate(payloads)}


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_int8_activations_change_a_greedy_token_only_where_the_float_twin_nearly_ties(tmp_path, kind, method):
    """AVX-512 VNNI rounds activations to int8 (per row and group), so its tokens are not its float
    twin's bit for bit. Until a request's first different token, each token's logprob is the twin's
    within 0.5, and a token differs only where the twin's two best were within 0.5 of each other.
    A wrong code, scale or offset in the kernel moves logprobs by more, and flips confident tokens."""
    if "avx512vnni" not in kernels.load().isas:
        pytest.skip(f"this CPU ({kernels.cpu_model()}) has no AVX-512 VNNI")
    folder = build_model(tmp_path / kind, kind)
    texts = prompts(12, seed=3)
    want = greedy_events(engine_of(float_twin(folder, method), folder, FP32), texts)
    engine = engine_of(compressed(folder, method, tmp_path / "cache"), folder, "avx512vnni")
    assert engine.runner.lm_head.quant.int8
    got = greedy_events(engine, texts)
    assert want.keys() == got.keys()
    compared = 0
    for rid, theirs in want.items():
        for i, (a, b) in enumerate(zip(theirs, got[rid])):
            margin = a.top_logprobs[0][1] - a.top_logprobs[1][1]
            if a.token_id != b.token_id:
                assert margin <= 0.5, f"{rid} token {i}: {b.token_id} for {a.token_id}, {margin:.3f} ahead"
                break
            assert abs(a.logprob - b.logprob) <= 0.5, f"{rid} token {i}: logprob {b.logprob} for {a.logprob}"
            compared += 1
    assert compared >= len(texts) * NEW_TOKENS // 4  # not vacuous: tiny models tie often


def test_compression_is_refused_where_no_quantized_path_runs(tiny_opt, tmp_path):
    with pytest.raises(ValueError, match="quantization=int8 needs a llama-family or Gemma 3 model"):
        compressed(tiny_opt, "int8", tmp_path)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q5_1"])
def test_a_gguf_file_served_quantized_decodes_as_transformers_dequantized_load(tiny_llama, tmp_path, qtype):
    """Every 2-D tensor of the file (projections, embedding, head) in `qtype`: the worker's loader
    keeps them quantized, and the engine's greedy tokens equal those of the same engine on
    transformers' own (dequantizing) load of the file."""
    from transformers import AutoModelForCausalLM

    path = write_tiny_gguf(tiny_llama, tmp_path / f"tiny.{qtype}.gguf", qtype=qtype)
    settings = WorkerSettings(_env_file=None, model=str(path), model_cache_dir=tmp_path / "cache")
    model = load_weights(settings, CPU, torch.float32)
    assert quant_model.is_quantized(model) and quant_model.quantized(model.model.embed_tokens) is not None
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    texts = prompts(5, seed=11)
    want = [s.output_ids for s in run(engine_of(theirs, tiny_llama, FP32), texts)]
    assert [s.output_ids for s in run(engine_of(model, tiny_llama, FP32), texts)] == want


def test_a_phi3_gguf_file_served_quantized_decodes_as_transformers_dequantized_load(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = build_model(tmp_path / "phi3", "phi3")
    path = write_tiny_gguf(folder, tmp_path / "phi3.Q8_0.gguf", qtype="Q8_0")
    model = load_weights(WorkerSettings(_env_file=None, model=str(path), model_cache_dir=tmp_path / "cache"),
                         CPU, torch.float32)
    assert model.config.model_type == "phi3"
    assert quant_model.quantized(model.model.layers[0].mlp.gate_up_proj).shape == (2 * 128, 64)
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    texts = prompts(5, seed=11)
    want = [s.output_ids for s in run(engine_of(theirs, folder, FP32), texts)]
    assert [s.output_ids for s in run(engine_of(model, folder, FP32), texts)] == want


def test_prefix_caching_and_chunked_prefill_on_quantized_weights(tiny_llama, tmp_path):
    shared = "the capital of France is Paris and streams batches caches " * 3
    texts = [shared + tail for tail in ("one", "two", "three", "four")]
    miss = run(engine_of(compressed(tiny_llama, "int4", tmp_path), tiny_llama, prefix=False, budget=8), texts,
               arrive_every=6)
    engine = engine_of(compressed(tiny_llama, "int4", tmp_path), tiny_llama, budget=8)
    hit = run(engine, texts, arrive_every=6)
    assert engine.batcher.blocks.prefix_hits > 0
    assert [s.output_ids for s in hit] == [s.output_ids for s in miss]


def test_speculation_on_quantized_weights_changes_no_token(tiny_llama, tmp_path):
    texts = [t * 3 for t in prompts(3, seed=5)]  # repeating itself, for prompt lookup to propose
    plain = [s.output_ids for s in run(engine_of(compressed(tiny_llama, "int8", tmp_path), tiny_llama), texts)]
    engine = engine_of(compressed(tiny_llama, "int8", tmp_path), tiny_llama)
    engine.speculator = Speculator(NgramProposer(4, 1, 3), 4)
    assert [s.output_ids for s in run(engine, texts)] == plain
    assert engine.speculator.stats.proposed > 0


def test_deterministic_mode_on_quantized_weights(tiny_llama, tmp_path):
    """The quantized kernels compute each row alone: a request's tokens are the same alone or in
    a batch, without fixed tiles."""
    texts = prompts(8, seed=9)

    def engine():
        model = compressed(tiny_llama, "int4", tmp_path)
        runner = PagedRunner(model, CPU, 256, 4, kernels.load(), deterministic=True)
        return Engine(runner, Tokenizer(tiny_llama), Batcher(BlockManager(256, 4, True), 8, 32))
    together = engine()
    assert not together.runner.lm_head.tile  # rows computed alone: no tiles needed
    batch = [s.output_ids for s in run(together, texts)]
    assert [run(engine(), [t])[0].output_ids for t in texts[:3]] == batch[:3]


def test_structured_outputs_on_quantized_weights(tiny_llama, tmp_path):
    from tests.unit.test_structured_outputs import SCHEMA, _payload, _valid

    engine = engine_of(compressed(tiny_llama, "int4", tmp_path), tiny_llama)
    seqs = engine.generate([_payload(f"s{seed}", engine.tokenizer.encode("hi"), temperature=1.2, seed=seed,
                                     structured_outputs={"json": SCHEMA}, max_tokens=120) for seed in range(3)])
    for seq in seqs:
        assert _valid(json.loads(engine.tokenizer.decode(seq.output_ids)))


@pytest.mark.parametrize("isa", ["avx512vnni", "avx512", "avx2", "portable"])  # each packed layout
@pytest.mark.parametrize("bits, offset", [(4, True), (8, False), (8, True)])
def test_a_tied_embedding_reads_its_rows_from_the_heads_packed_table(isa, bits, offset):
    from worker.model.quant_linear import QuantLinear
    from worker.model.quantized import QuantizedWeight, quantize

    if isa != "portable" and isa not in kernels.load().isas:
        pytest.skip(f"this CPU ({kernels.cpu_model()}) has no {isa}")

    w = quantize(torch.randn(70, 64, generator=torch.Generator().manual_seed(bits)), bits, 32)
    if w.offset is None and offset:
        w = QuantizedWeight(w.q, w.scale, torch.rand_like(w.scale), w.group, w.bits)
    ops = kernels.with_isa(kernels.load(), isa)
    head = QuantLinear(w, None, ops if isa != "portable" else None)
    embedding = quant_model.QuantizedEmbedding(w, torch.float32, head=head)
    ids = torch.tensor([[0, 5, 31], [32, 69, 5]])  # either side of a panel's edge, N not a multiple of 32
    assert embedding.table is None  # it holds nothing of its own
    assert torch.equal(embedding(ids), w.dequantize()[ids])
