"""Which forward a paged runner takes, chosen once, before anything is built, from the model, the
device, the dtype and the settings (kernels on or off, CUDA graphs' batch, deterministic mode), and
which models no forward serves (`supports`: they go to worker/backends/static_engine.py).
PagedRunner builds what the plan names and runs the forward the plan names
(worker/model/forwards/); nothing else decides a path. worker/engine/execution_plan.py reports it
with what the built weights add (their kernels, the one-call stack)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.model import quant_model
from worker.model.fused_layers import fusable
from worker.model.kernels import cpu_has

# On a CPU with AMX, a bf16 projection of this many rows or more runs on oneDNN's prepacked matmul,
# which computes on the AMX tiles: it took 0.7-1.5x panel_linear's time at 5 rows (the larger
# projections the less), 0.15-0.3x at 32, 0.08-0.19x at 2,048 (the default model's projections and
# head, 2 cores); panel_linear took 0.4-0.8x oneDNN's at 1 and 2 rows (docs/engine.md).
AMX_MATMUL_ROWS = 5

# Deterministic mode: a projection that does not compute each row alone (a library matmul) gets
# calls of exactly this many rows, the last padded, whatever the step holds.
DETERMINISTIC_TILE = 16

ARCHS = {"opt": "opt", "gemma3_text": "gemma3"}  # model_type -> forward; any other: the llama family's
# Qwen2-VL's and Qwen2.5-VL's language models: a Qwen2 whose rotary takes M-RoPE's three axes of
# positions (StepInputs.rope, from the request's images: worker/engine/vision.py)
MROPE = frozenset({"qwen2_vl_text", "qwen2_5_vl_text"})
SUPPORTED = quant_model.LLAMA_FAMILY | set(ARCHS) | MROPE


def supports(model: torch.nn.Module) -> bool:
    """Whether a paged forward serves `model`."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind == "gemma3_text":  # softcapped attention scores and bidirectional attention are not done here
        return config.attn_logit_softcapping is None and not getattr(config, "use_bidirectional_attention", False)
    if kind == "phi3":  # its fused qkv_proj and gate_up_proj run on the fused layers only, rotary on whole heads
        return fusable(model) and float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) == 1.0
    return kind in SUPPORTED


@dataclass(frozen=True)
class ForwardPlan:
    arch: str  # llama | gemma3 | opt
    fused: bool  # projections fused into Weights (q/k/v and gate/up each one), packed or kept quantized
    kernels: bool  # the CPU step kernels run the norms, rotary, cache writes and attention
    graphs: bool  # decode steps replayed from CUDA graphs (on a CPU, their static buffers, for tests)
    matmul_rows: int  # from how many rows a projection on panels calls oneDNN's matmul instead (0: never)
    deterministic: bool  # every token computed alone, whatever else the step holds

    @property
    def tile(self) -> int:
        """Rows a library matmul call takes, padded (0: any number; deterministic mode's DETERMINISTIC_TILE)."""
        return DETERMINISTIC_TILE if self.deterministic else 0

    @property
    def forward(self) -> str:
        """llama-kernels | llama-fused | llama-eager | gemma3 | opt."""
        if self.arch != "llama":
            return self.arch
        if not self.fused:
            return "llama-eager"
        return "llama-kernels" if self.kernels else "llama-fused"

    @property
    def one_token_stack(self) -> bool:
        """Whether a one-token step may run the whole layer stack in one kernel call: the llama
        layers on the CPU kernels, where every projection has a kernel form (the built weights say)."""
        return self.forward == "llama-kernels"


def choose(model: torch.nn.Module, device: torch.device, *, kernels: bool, graph_batch: int = 0,
           deterministic: bool = False, matmul_rows: int | None = None, fuse: bool = True) -> ForwardPlan:
    """The plan for `model` (its weights' dtype) on `device`. `kernels`: the CPU step kernels are
    loaded (cpu_kernels on); `graph_batch`: CUDA graphs' largest batch (0: off); `matmul_rows`:
    None picks AMX_MATMUL_ROWS for bf16 on a CPU with AMX, else never; `fuse`: False keeps the
    modules' own projections (the reference path, for tests). Refuses what no path serves."""
    if not supports(model):
        raise ValueError(f"no paged runner for model_type={model.config.model_type!r}; "
                         f"supported: {sorted(SUPPORTED)}")
    arch = ARCHS.get(model.config.model_type, "llama")
    dtype = next(model.parameters()).dtype
    fused = fuse and ((arch == "llama" and fusable(model)) or arch == "gemma3")
    if quant_model.is_quantized(model) and not fused:
        raise ValueError(f"quantized weights run on the fused llama-family or Gemma 3 layers; "
                         f"model_type={model.config.model_type!r} has none")
    # Decode graphs: the fused llama layers, unless the CPU kernels are loaded on a CPU (their step is
    # faster); not with M-RoPE, whose positions a graph's buffers do not carry.
    graphs = graph_batch > 0 and fused and arch == "llama" and not (kernels and device.type == "cpu") \
        and model.config.model_type not in MROPE
    # The kernels serve fp32 and bf16 on a CPU; on a GPU, in fp16 or without them the eager ops run.
    kernels = kernels and fused and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    if deterministic and not (kernels and arch == "llama"):
        raise ValueError("deterministic mode runs on the CPU step kernels (fp32 or bf16, cpu_kernels on, "
                         "a llama-like model); this worker has none")
    if deterministic and matmul_rows:
        raise ValueError("deterministic mode gives every call of a projection on panels to the panels "
                         f"(matmul_rows 0), not {matmul_rows}")
    if matmul_rows is None:
        amx = dtype == torch.bfloat16 and device.type == "cpu" and cpu_has("amx_bf16") and not deterministic
        matmul_rows = AMX_MATMUL_ROWS if amx else 0
    return ForwardPlan(arch, fused, kernels, graphs, matmul_rows, deterministic)
