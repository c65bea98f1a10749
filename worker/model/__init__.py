"""Tensors and kernels: a model's weights loaded (float, quantized or from GGUF), its LoRA adapters,
the paged KV cache and one forward over a step's batch (batch.py), on the CPU step kernels
(csrc/), CUDA graphs or torch's ops. forward_plan.py chooses the forward; model_runner.py builds
it and runs it, one module per forward in forwards/ (which never import model_runner.py).

May import: shared/ and this package only; never the engine (a step's batch comes in as
batch.py's dataclasses).
"""
