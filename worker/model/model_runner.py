"""The paged model runner: one forward per step over every scheduled request.

Prefill chunks and decodes run in the same forward, each request at its own positions. The
projections and MLPs run on all the step's tokens at once; attention reads each request's keys
and values from the paged KV cache through its block table. No per-request Python loop runs
inside a layer.

The runner builds what the plan (worker/model/forward_plan.py `choose`) names and runs the forward
it names, one module each in worker/model/forwards/; each step it builds the inputs
(worker/model/runner_inputs.py), picks each row's LoRA adapter (worker/model/lora_step.py), and
replays CUDA graphs (worker/model/cuda_graphs.py) for the decode steps that fit them. The KV cache
(worker/model/kv_cache.py) is allocated once, at start, and never grows. The weights are
transformers' own modules; the fused paths add their fused projections (worker/model/
fused_layers.py) and head (worker/model/lm_head.py). Llama-family models (Llama, Mistral, Qwen2,
Qwen3, Phi-3, SmolLM), Gemma 3 and OPT run here, sliding windows applied; other architectures use
worker/backends/static_engine.py.
"""
from __future__ import annotations

from types import ModuleType

import torch

from shared.tokenizer import served_context
from worker.model import kv_cache, lm_head, quant_model
from worker.model.batch import SchedulerOutput
from worker.model.cuda_graphs import DecodeGraphs
from worker.model.forward_plan import MROPE, choose
from worker.model.forwards import gemma, llama_eager, llama_fused, llama_kernels, opt
from worker.model.fused_layers import Weight, fuse
from worker.model.lora_step import StepLora
from worker.model.runner_inputs import step_inputs

# The plan's forward names (ForwardPlan.forward) -> forward(runner, step).
FORWARDS = {"llama-kernels": llama_kernels.forward, "llama-fused": llama_fused.forward,
            "llama-eager": llama_eager.forward, "gemma3": gemma.forward, "opt": opt.forward}


class PagedRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, num_blocks: int, block_size: int,
                 kernels: ModuleType | None = None, graph_batch: int = 0, deterministic: bool = False,
                 matmul_rows: int | None = None, fuse: bool = True):
        """Builds the forward worker/model/forward_plan.py chooses (`self.plan`). `deterministic`:
        every token computed alone, whatever else the step holds (_fuse). `matmul_rows`: from how
        many rows a call of a projection on panels runs on oneDNN's matmul instead (Weight); None:
        AMX_MATMUL_ROWS for bf16 on a CPU with AMX, else never. `fuse`: False runs the modules' own
        projections, step by step (the reference path, for tests)."""
        plan = self.plan = choose(model, device, kernels=kernels is not None, graph_batch=graph_batch,
                                  deterministic=deterministic, matmul_rows=matmul_rows, fuse=fuse)
        self.model = model
        self.vocab_size = quant_model.vocab_size(model)  # the logits' width
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        _, self.kv_heads, self.head_dim = kv_cache.kv_shape(model)
        dtype = next(model.parameters()).dtype
        self.context_length = served_context(model.config.to_dict())
        # Sliding-window layers attend to the last `window` keys only: the paged kernel skips the
        # rest, the gathered groups mask them. The cache still holds every position.
        self.windows = kv_cache.layer_windows(model.config)
        self.window = max(self.windows)  # one window per model: the config's sliding_window
        self.mrope = model.config.model_type in MROPE  # positions on three axes, from the requests' images
        self.both_ways = bool(getattr(model, "images_both_ways", False))  # an image's tokens see each other (Gemma 3)
        # Decode graphs pad their batch with rows that write to one more block, never handed out.
        self.k_cache, self.v_cache = kv_cache.allocate(model, dtype, device, num_blocks + plan.graphs, block_size)
        # The CPU step kernels (worker/model/kernels.py) run the fused layers' norms, rotary, cache
        # writes and short-chunk attention where the plan has them.
        self.kernels = kernels if plan.kernels else None
        # Every projection and the LM head run on the kernels' panel_linear where this CPU has it
        # for the dtype (Weight decides). AVX-512 (bf16: AVX512-BF16): 1.2-1.9x oneDNN's prepacked
        # matmul per step at 1 to 64 rows, on par at prefill sizes (docs/engine.md); AVX2, fp32 only:
        # 1.2-2x at one or two rows, on par (within the noise of a shared machine) from 4 rows up.
        # The fused weights come after the cache: made first, one-stream bf16 decoding measured
        # 5 % slower (benchmarks/engine.py single, interleaved rounds); the pages' placement, not understood.
        self.fused = self.lm_head = self.eps = self.scale = None
        if plan.fused:
            self._fuse(dtype)
        self.adapters = None  # the LoRA adapters served (worker/model/lora.py Adapters), set by the worker where any
        self.forward = FORWARDS[plan.forward]  # forward(runner, step)
        # The whole layer stack in one kernel call, for a step of one token, where every projection
        # has a kernel form.
        self.one_token = self._one_token_layers() if plan.one_token_stack else None
        # On CUDA, decode steps replay CUDA graphs (worker/model/cuda_graphs.py) of the plan's forward
        # (llama-fused); on a CPU the same static-buffer step runs eagerly, which only the tests ask for.
        self.graphs = DecodeGraphs(self, self.forward, graph_batch, num_blocks) if plan.graphs else None

    # What the plan chose, read from it (self.plan is the one record of it).
    matmul_rows = property(lambda self: self.plan.matmul_rows)
    deterministic = property(lambda self: self.plan.deterministic)

    def _fuse(self, dtype: torch.dtype) -> None:
        """The fused layers' weights, and the head's (the panels or packed codes of the kernels
        where they run); a quantized tied embedding reads the head's table. Deterministic mode
        (the plan's tile): a token's result depends on its own sequence only. Every chunk attends
        through the paged kernel (as it does without the mode), and every projection computes each
        row alone: panel_linear or the quantized kernels (as without the mode, but for bf16 on a CPU
        with AMX, whose calls of many rows go to oneDNN otherwise: the plan's matmul_rows is 0),
        or the library's matmul in fixed tiles where the CPU has no panels for the dtype."""
        model, plan = self.model, self.plan
        self.fused = fuse(model, self.device, self.kernels, plan.matmul_rows, plan.tile)
        self.lm_head = lm_head.build(model, self.device, self.kernels, plan.matmul_rows, plan.tile, dtype)
        first = model.model.layers[0]  # every layer's norm epsilon and attention scale are the first's
        self.eps = getattr(first.input_layernorm, "variance_epsilon", None)
        self.scale = getattr(first.self_attn, "scaling", self.head_dim ** -0.5)

    def _one_token_layers(self):
        """The kernels' one-call layer stack, or None (worker/model/forwards/llama_kernels.py)."""
        return llama_kernels.one_token_stack(self)

    def projections(self) -> list[Weight]:
        """Every fused projection of every layer, and the head."""
        return [w for layer in self.fused for w in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.lm_head]

    @property
    def batch_invariant(self) -> bool:
        """Whether a token's result depends on its own sequence only, so that greedy and seeded
        tokens are the same alone or in any batch, with the prefill chunked anyhow or its prefix
        cached, with speculation, and continued by another worker after a failover: the llama
        layers on the CPU step kernels (every chunk on the paged kernel), every projection and the
        head computing each row alone. Not so for bf16 on a CPU with AMX, whose calls of many rows
        run on oneDNN, nor without panels for the dtype, unless in deterministic mode.
        This is the base model's requests': a row with a LoRA adapter adds a delta computed over
        the step's rows of its adapter (or of all its adapters, stacked), whose rounding hangs on
        that count, unless in deterministic mode (fixed tiles); a base row gets no delta at all."""
        if self.plan.forward != "llama-kernels":
            return False
        return all(w.row_independent or w.tile for w in self.projections())

    @property
    def numerics(self) -> tuple:
        """What decides the bits a step computes, besides the weights: the dtype, the device, the
        kernels' ISA, oneDNN's matmul from how many rows, and whether each token is computed alone."""
        kernels = self.kernels
        isa = None if kernels is None else getattr(kernels, "isa", None) or next(iter(kernels.isas), "portable")
        return str(self.k_cache.dtype), self.device.type, isa, self.matmul_rows, self.batch_invariant

    @property
    def block_kv_bytes(self) -> int:
        """Bytes of one cache block's keys and values, all layers (what read_block gives)."""
        return kv_cache.block_bytes(self.k_cache)

    def read_block(self, block_id: int) -> bytes:
        """One cache block's keys then values, every layer, as the cache holds them."""
        return kv_cache.read_block(self.k_cache, self.v_cache, block_id)

    def write_block(self, block_id: int, data: bytes | memoryview) -> None:
        """Put `data` (read_block's form) in cache block `block_id`."""
        kv_cache.write_block(self.k_cache, self.v_cache, block_id, data)

    def weight_bytes(self) -> int:
        """Bytes of weights the step reads from: the fused projections and head in every form they
        are held, the embedding (its quantized table, or its float rows) and the norms."""
        if self.fused is None:
            return sum(p.numel() * p.element_size() for p in self.model.parameters())
        embed = self.model.model.embed_tokens
        if isinstance(embed, quant_model.QuantizedEmbedding):
            table = embed.table.nbytes() if embed.table is not None else 0  # tied: the head's table
        else:
            table = embed.weight.numel() * embed.weight.element_size()
        norms = sum(w.ln1.numel() + w.ln2.numel() for w in self.fused) * self.fused[0].ln1.element_size()
        return sum(w.nbytes() for w in self.projections()) + table + norms

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, hidden: bool = False,
                images: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
        """Run the step's chunks; return the logits the chunks need (Chunk.num_logits each: a
        sampling chunk's last token, and one row per proposed token), in chunk order; with
        `hidden`, those tokens' final hidden states instead (pooling: embeddings). `images`: the
        step's image-token rows (flat) and the embeddings that take their tokens' place."""
        # CUDA graphs and the one-token layer stack add no deltas: a step with adapter rows runs per layer.
        lora = StepLora.of(out.chunks, self.adapters, self.device) if self.adapters is not None else None
        if not hidden and lora is None and images is None and self.graphs is not None and self.graphs.fits(out):
            return self.graphs.execute(out)
        step = step_inputs(out.chunks, self.device, self.block_size, self.window, self.plan.kernels, self.mrope,
                           self.both_ways)
        step.lora = lora
        step.hidden = hidden
        if images is not None:
            rows, embeddings = images
            step.image_rows = torch.tensor(rows, dtype=torch.long, device=self.device)
            step.image_embeddings = embeddings.to(self.device)
        return self.forward(self, step)
