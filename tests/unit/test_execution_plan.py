"""The execution plan read off a built runner, for each path it can take: the CPU kernels (their
ISA as this CPU has it, and the portable path forced), the fused ops without them, the modules'
eager ops, quantized weights, and another architecture."""
from __future__ import annotations

import torch

from shared.tokenizer import Tokenizer
from worker.model import kernels
from worker.engine.batcher import Batcher
from worker.engine.block_manager import BlockManager
from worker.engine.core import Engine
from worker.model.model_loader import load_model
from worker.model.model_runner import PagedRunner
from worker.backends.null_engine import NullEngine
from worker.model.quantized import quantize

CPU = torch.device("cpu")


def plan(folder, ops, *, eager: bool = False, quantized: bool = False):
    model = load_model(folder, CPU, torch.float32)
    if quantized:
        for layer in model.model.layers:
            for module in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                           layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                module.quantized = quantize(module.weight.data, 8, 32)
    runner = PagedRunner(model, CPU, 16, 4, ops, fuse=not eager)
    return Engine(runner, Tokenizer(folder), Batcher(BlockManager(16, 4), 4, 32)).plan


def test_the_kernels_plan_names_this_cpus_isa_and_the_portable_one_when_forced(tiny_llama):
    built = kernels.load()
    auto = plan(tiny_llama, built)
    assert (auto.engine, auto.forward, auto.dtype, auto.device) == ("paged", "llama-kernels", "float32", "cpu")
    assert auto.projections == "panels" and auto.one_token_stack and auto.isa == built.isas[0]
    assert auto.batch_invariant
    portable = plan(tiny_llama, kernels.with_isa(built, "portable"))
    assert (portable.forward, portable.projections, portable.isa) == ("llama-kernels", "onednn", "portable")
    assert portable.one_token_stack  # its layer stack calls the library's matmul for float weights


def test_the_plans_without_kernels(tiny_llama, tiny_opt):
    fused = plan(tiny_llama, None)
    assert (fused.forward, fused.projections, fused.isa, fused.batch_invariant) == ("llama-fused", "onednn",
                                                                                    "portable", False)
    eager = plan(tiny_llama, None, eager=True)
    assert (eager.forward, eager.projections) == ("llama-eager", "modules")
    assert plan(tiny_opt, None).forward == "opt"


def test_quantized_weights_name_their_kernels(tiny_llama):
    built = kernels.load()
    auto = plan(tiny_llama, built, quantized=True)
    assert auto.projections == ("panels+quantized-int8" if built.isas[0] == "avx512vnni" else "panels+quantized")
    portable = plan(tiny_llama, kernels.with_isa(built, "portable"), quantized=True)
    assert portable.projections == "onednn+quantized-portable"


def test_labels_are_strings_for_the_metric_and_the_null_engines_plan():
    null = NullEngine(4, 10.0).plan
    assert null.engine == "null" and null.labels()["one_token_stack"] == "false"
    assert all(isinstance(v, str) for v in null.labels().values())


def test_each_weight_has_one_kind_that_its_kernel_follows(tiny_llama):
    """A Weight's kind is chosen once; the tensors it keeps are those of its kind."""
    from worker.model.fused_layers import MATMUL, ONEDNN, PANELS, QUANTIZED, Weight
    from worker.model.quantized import quantize as quantize_rows

    w = torch.randn(32, 64)
    built = kernels.load()
    panels = Weight(w, None, CPU, built)
    assert panels.kind == PANELS and panels.panels is not None and panels.packed is None
    onednn = Weight(w, None, CPU, kernels.with_isa(built, "portable"))  # no panels for any dtype
    assert onednn.kind in (ONEDNN, MATMUL) and onednn.panels is None
    assert (onednn.kind == ONEDNN) == (onednn.packed is not None)
    quantized = Weight(quantize_rows(w, 8, 32), None, CPU, built)
    assert quantized.kind == QUANTIZED and quantized.w is None and quantized.panels is None
    x = torch.randn(3, 64)
    for weight in (panels, onednn):
        torch.testing.assert_close(weight(x), x @ w.T, rtol=0, atol=1e-4)
