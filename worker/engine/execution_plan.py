"""Which paths a worker's engine takes, said once: the forward, the projections' kernels, whether
the weights stay quantized, the one-call decode stack, CUDA graphs, and what that makes of its
numerics. The paged runner's forward is chosen once, before it is built (worker/model/
forward_plan.py); the rest is read off what it built. Logged at start,
sent in the heartbeat (so /readyz's worker entry shows it) and as a metric's labels."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ExecutionPlan:
    engine: str  # paged | static | encoder | null | vllm
    forward: str  # paged: llama-kernels | llama-fused | llama-eager | gemma3 | opt; encoder: its family; else the engine's
    projections: str  # each Weight kind, +-joined: panels (AVX2/AVX-512 kernels) | panels, onednn from N rows | onednn | matmul (a GPU) | quantized... ("..., tiled": deterministic mode) | modules | n/a
    one_token_stack: bool  # a one-token step runs the whole layer stack in one kernel call
    cuda_graphs: bool
    dtype: str
    device: str
    isa: str  # the kernels' projection ISA (portable: none)
    deterministic: bool
    batch_invariant: bool

    def labels(self) -> dict[str, str]:
        return {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in asdict(self).items()}

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.labels().items())


def paged_plan(runner) -> ExecutionPlan:
    """The plan of the paged engine, read off its runner (worker/model/model_runner.py PagedRunner)."""
    dtype, device, isa, _, invariant = runner.numerics
    return ExecutionPlan("paged", runner.plan.forward, _projections(runner), runner.one_token is not None,
                         runner.graphs is not None, dtype.removeprefix("torch."), device, isa or "portable",
                         runner.deterministic, invariant)


def static_plan(dtype: str, device: str) -> ExecutionPlan:
    """The static-batch engine's: the model's own modules, in `dtype` on `device`."""
    return ExecutionPlan("static", "static", "n/a", False, False, dtype.removeprefix("torch."), device, "n/a",
                         False, False)


def encoder_plan(family: str, dtype: str, device: str) -> ExecutionPlan:
    """An encoder's (worker/engine/encoder_engine.py): packed inputs through the model's own modules."""
    return ExecutionPlan("encoder", family, "modules", False, False, dtype.removeprefix("torch."), device, "n/a",
                         False, False)


def null_plan() -> ExecutionPlan:
    """The null engine's: no model."""
    return ExecutionPlan("null", "null", "n/a", False, False, "n/a", "n/a", "n/a", False, False)


def vllm_plan(dtype: str, device: str, deterministic: bool) -> ExecutionPlan:
    return ExecutionPlan("vllm", "vllm", "vllm", False, False, dtype, device, "n/a", deterministic, deterministic)


def _projections(runner) -> str:
    if runner.fused is None:
        return "modules"  # the model's own nn.Linear
    kinds = sorted({_kind(w) for w in runner.projections()})
    return "+".join(kinds)


def _kind(w) -> str:
    if w.kind == "quantized":
        quant = w.quant
        return "quantized-int8" if quant.int8 else "quantized" if quant.packed is not None else "quantized-portable"
    if w.kind == "panels":
        return f"panels, onednn from {w.matmul_rows} rows" if w.matmul_rows else "panels"
    return f"{w.kind}, tiled" if w.tile else w.kind
