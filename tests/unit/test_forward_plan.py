"""The paged runner's forward, chosen once from the model, device, dtype and settings (worker/model/
forward_plan.py), on any CPU: the AMX choice is tested both ways by telling the plan what the CPU has."""
from __future__ import annotations

import pytest
import torch

from worker.model import forward_plan, kernels
from worker.model.forward_plan import AMX_MATMUL_ROWS, choose
from worker.model.model_loader import load_model
from worker.model.model_runner import FORWARDS, PagedRunner
from worker.model.quantized import quantize

CPU = torch.device("cpu")


def test_the_llama_paths(tiny_llama):
    model = load_model(tiny_llama, CPU, torch.float32)
    assert choose(model, CPU, kernels=True).forward == "llama-kernels"
    assert choose(model, CPU, kernels=False).forward == "llama-fused"
    assert choose(model, CPU, kernels=True, fuse=False).forward == "llama-eager"
    assert not choose(model, CPU, kernels=True, fuse=False).kernels  # the kernels run the fused layers only
    # Decode graphs: without the CPU kernels only (on a CPU, the static buffers the tests run)
    assert choose(model, CPU, kernels=False, graph_batch=8).graphs
    assert not choose(model, CPU, kernels=True, graph_batch=8).graphs
    assert not choose(model, CPU, kernels=False, graph_batch=0).graphs


def test_the_kernels_serve_fp32_and_bf16_only(tiny_llama):
    half = load_model(tiny_llama, CPU, torch.float16)
    plan = choose(half, CPU, kernels=True, graph_batch=8)
    assert (plan.forward, plan.graphs) == ("llama-fused", False)  # graphs stay off where kernels are loaded on a CPU


def test_other_architectures_and_what_no_path_serves(tiny_llama, tiny_opt):
    opt = load_model(tiny_opt, CPU, torch.float32)
    assert (choose(opt, CPU, kernels=True).forward, choose(opt, CPU, kernels=True).fused) == ("opt", False)
    opt.model.decoder.layers[0].self_attn.q_proj.quantized = quantize(
        opt.model.decoder.layers[0].self_attn.q_proj.weight.data, 8, 32)
    with pytest.raises(ValueError, match="quantized weights"):
        choose(opt, CPU, kernels=True)
    llama = load_model(tiny_llama, CPU, torch.float32)
    with pytest.raises(ValueError, match="deterministic mode"):
        choose(llama, CPU, kernels=False, deterministic=True)
    assert choose(llama, CPU, kernels=True, deterministic=True).deterministic


@pytest.mark.parametrize("amx", [True, False])
def test_onednn_from_a_few_rows_for_bf16_where_the_cpu_has_amx(tiny_llama, monkeypatch, amx):
    monkeypatch.setattr(forward_plan, "cpu_has", lambda flag: amx and flag == "amx_bf16")
    bf16 = load_model(tiny_llama, CPU, torch.bfloat16)
    assert choose(bf16, CPU, kernels=True).matmul_rows == (AMX_MATMUL_ROWS if amx else 0)
    assert choose(bf16, CPU, kernels=True, deterministic=True).matmul_rows == 0  # every row alone
    assert choose(bf16, CPU, kernels=True, matmul_rows=7).matmul_rows == 7  # a setting wins
    with pytest.raises(ValueError, match="deterministic mode gives every call"):
        choose(bf16, CPU, kernels=True, deterministic=True, matmul_rows=7)
    assert choose(load_model(tiny_llama, CPU, torch.float32), CPU, kernels=True).matmul_rows == 0


def test_deterministic_mode_is_built_in_not_applied_after(tiny_llama):
    """The plan's tile reaches each projection as it is built: a weight on the kernels' panels
    computes each row alone and needs none, a library matmul (the portable path) takes calls of
    exactly that many rows, and then the one-token stack, which would call it on one row, is not built."""
    model = load_model(tiny_llama, CPU, torch.float32)
    assert choose(model, CPU, kernels=True, deterministic=True).tile == forward_plan.DETERMINISTIC_TILE
    assert choose(model, CPU, kernels=True).tile == 0
    built = kernels.load()
    for ops in (built, kernels.with_isa(built, "portable")):
        runner = PagedRunner(load_model(tiny_llama, CPU, torch.float32), CPU, 64, 4, ops, deterministic=True)
        panels = "float32" in ops.panel_dtypes
        assert {w.tile for w in runner.projections()} == {0 if panels else forward_plan.DETERMINISTIC_TILE}
        assert runner.batch_invariant and (runner.one_token is None) == (not panels)


@pytest.mark.parametrize("path", ["kernels", "portable", "fused", "eager"])
def test_the_runner_builds_what_the_plan_names(tiny_llama, path):
    ops = kernels.load() if path in ("kernels", "portable") else None
    if path == "portable":
        ops = kernels.with_isa(ops, "portable")
    model = load_model(tiny_llama, CPU, torch.float32)
    runner = PagedRunner(model, CPU, 16, 4, ops, graph_batch=4, fuse=path != "eager")
    plan = runner.plan
    assert plan == choose(model, CPU, kernels=ops is not None, graph_batch=4, fuse=path != "eager")
    assert plan.forward == {"kernels": "llama-kernels", "portable": "llama-kernels", "fused": "llama-fused",
                            "eager": "llama-eager"}[path]
    assert (runner.kernels is not None) == plan.kernels
    assert (runner.fused is not None) == plan.fused
    assert (runner.graphs is not None) == plan.graphs == (path == "fused")
    assert runner.matmul_rows == plan.matmul_rows


def test_the_runner_runs_the_forward_the_plan_names(tiny_llama, tiny_opt):
    """Looked up once by the plan's name (model_runner.FORWARDS, one module each in worker/model/forwards/)."""
    assert set(FORWARDS) == {"llama-kernels", "llama-fused", "llama-eager", "gemma3", "opt"}
    ops = kernels.load()
    for folder, kernels_on, fuse in ((tiny_llama, True, True), (tiny_llama, False, True), (tiny_llama, False, False),
                                     (tiny_opt, True, True)):
        runner = PagedRunner(load_model(folder, CPU, torch.float32), CPU, 16, 4, ops if kernels_on else None, fuse=fuse)
        assert runner.forward is FORWARDS[runner.plan.forward]
        assert runner.one_token is None or runner.plan.one_token_stack  # the stack: the llama kernels' only
