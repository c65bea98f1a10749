"""The fused llama layers (worker/model/fused_layers.py) against the model's own modules."""
from __future__ import annotations

import pytest
import torch

from tests.unit.test_engine import make_engine, prompts, run
from worker.engine.batcher import Batcher
from worker.engine.block_manager import BlockManager
from worker.engine.core import Engine
from worker.model.fused_layers import Weight
from worker.model import kernels as step_kernels
from worker.model.model_runner import PagedRunner
from worker.model.model_loader import load_model
from shared.tokenizer import Tokenizer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_weight_is_prepacked_where_onednn_packs_it(dtype):
    w = torch.randn((96, 64)).to(dtype)
    weight = Weight(w, None, torch.device("cpu"))
    try:
        want = torch.ops.mkldnn._reorder_linear_weight(w, 1)
    except (AttributeError, RuntimeError):
        want = None
    assert (weight.packed is None) == (want is None)


def test_an_fp32_prepacked_weight_computes_the_plain_matmul_to_rounding_at_every_batch_size():
    gen = torch.Generator().manual_seed(1)
    for shape in ((96, 64), (192, 64), (64, 128), (576, 576), (576, 1536)):
        w, b = torch.randn(shape, generator=gen), torch.randn(shape[0], generator=gen)
        weight = Weight(w, b, torch.device("cpu"))
        scale = shape[1] ** 0.5  # the outputs' size: a sum of `in` unit normal products
        for rows in range(1, 41):  # oneDNN picks its kernel by rows: one stream, decodes, chunks
            x = torch.randn((rows, shape[1]), generator=gen)
            torch.testing.assert_close(weight(x), torch.nn.functional.linear(x, w, b), rtol=0, atol=2e-5 * scale,
                                       msg=lambda m, shape=shape, rows=rows: f"{shape}, {rows} rows: {m}")


def test_a_bf16_prepacked_weight_computes_the_plain_matmul():
    w = torch.randn((96, 64)).to(torch.bfloat16)
    x = torch.randn((4, 64)).to(torch.bfloat16)
    torch.testing.assert_close(Weight(w, None, torch.device("cpu"))(x), torch.nn.functional.linear(x, w))


def test_fused_layers_give_the_tokens_of_the_modules_in_bf16(tiny_llama):
    texts = prompts(12, seed=5)
    fused = run(_engine(tiny_llama, fuse=True), texts, arrive_every=2)
    plain = run(_engine(tiny_llama, fuse=False), texts, arrive_every=2)
    assert [s.output_ids for s in fused] == [s.output_ids for s in plain]


def test_the_fused_path_is_the_one_that_runs(tiny_llama):
    assert make_engine(tiny_llama).runner.fused is not None


def _engine(folder, fuse: bool, kernels: bool = False, dtype=torch.bfloat16) -> Engine:
    model = load_model(folder, torch.device("cpu"), dtype)
    # fuse=False: the modules' own forward, step by step
    runner = PagedRunner(model, torch.device("cpu"), 256, 4, step_kernels.load() if kernels else None, fuse=fuse)
    return Engine(runner, Tokenizer(folder), Batcher(BlockManager(256, 4, True), 8, 32))


PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


@pytest.mark.parametrize("isa", ["fp32", "avx512vnni", "portable"])
def test_quantized_weights_decode_as_their_float_values_do(tiny_llama, isa):
    """Modules carrying QuantizedWeights (q and k 4-bit, the rest 8-bit: q/k/v fused across
    formats) give the greedy tokens of the same model with those weights dequantized to floats
    (with fp32 activations: the widest such kernels and the portable path); with the kernels a
    one-token step runs the whole stack quantized in one call, as the per-layer path does (on
    AVX-512 VNNI too, whose int8 activations test_quant_model compares with a float twin)."""
    from worker.model.quantized import quantize

    built = step_kernels.load()
    if isa == "avx512vnni" and isa not in built.isas:
        pytest.skip(f"this CPU ({step_kernels.cpu_model()}) has no AVX-512 VNNI")
    ops = step_kernels.with_isa(built, step_kernels.widest_fp32(built) if isa == "fp32" else isa)
    model = load_model(tiny_llama, torch.device("cpu"), torch.float32)
    modules = [layer.get_submodule(name) for layer in model.model.layers for name in PROJECTIONS]
    quantized = []
    for module, name in zip(modules, PROJECTIONS * len(model.model.layers)):
        quantized.append(quantize(module.weight.data, 4 if name.endswith(("q_proj", "k_proj")) else 8,
                                  16 if "mlp" in name else 32))
        module.weight.data = quantized[-1].dequantize()  # the float twin's weights: the same values
    float_twin = _runner_engine(tiny_llama, model, ops)
    for module, q in zip(modules, quantized):
        module.quantized = q
    engine = _runner_engine(tiny_llama, model, ops)
    assert all(w.quant is not None and w.w is None for layer in engine.runner.fused
               for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert (engine.runner.one_token is not None) == (isa != "portable")
    texts = prompts(6, seed=7)
    got = [s.output_ids for s in run(engine, texts)]
    if isa != "avx512vnni":
        assert got == [s.output_ids for s in run(float_twin, texts)]
    engine.runner.one_token = None
    assert [s.output_ids for s in run(engine, texts)] == got


def _runner_engine(folder, model, ops) -> Engine:
    runner = PagedRunner(model, torch.device("cpu"), 256, 4, ops)
    return Engine(runner, Tokenizer(folder), Batcher(BlockManager(256, 4, True), 8, 32))
