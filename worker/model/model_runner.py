"""The paged model runner: one forward per step over every scheduled request.

Prefill chunks and decodes run in the same forward, each request at its own positions. The
projections and MLPs run on all the step's tokens at once; attention reads each request's
keys and values from the paged KV cache through its block table. With the CPU step kernels,
every chunk attends in one kernel call a layer, each token computed alone (the same bits in any
batch or chunk); otherwise requests are grouped by chunk length (decodes, short chunks such as
speculative verifies, long prefill chunks), so attention is at most three batched calls per
layer. No per-request Python loop runs inside a layer.

The KV cache is allocated once, at start, and never grows. The weights are transformers'
own modules; this file only decides how they are called. Llama-family models (Llama,
Mistral, Qwen2, Qwen3, Phi-3, SmolLM), Gemma 3 and OPT run here, sliding windows applied; other
architectures use worker/backends/static_engine.py.
"""
from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from shared.tokenizer import served_context
from worker.model import quant_model
from worker.model.cuda_graphs import DecodeGraphs
from worker.model.fused_layers import Weight, after_attention, before_attention, fusable, fuse, rotate_half
from worker.model.forward_plan import choose
from worker.model.quant_linear import float_activations_on
from worker.model.batch import AttentionGroup, Paged, SchedulerOutput, StepInputs
from worker.model.lora_step import StepLora

SUPPORTED = quant_model.LLAMA_FAMILY | {"opt", "gemma3_text"}


def supports(model: torch.nn.Module) -> bool:
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind == "gemma3_text":  # softcapped attention scores and bidirectional attention are not done here
        return config.attn_logit_softcapping is None and not getattr(config, "use_bidirectional_attention", False)
    if kind == "phi3":  # its fused qkv_proj and gate_up_proj run on the fused layers only, rotary on whole heads
        return fusable(model) and float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) == 1.0
    return kind in SUPPORTED


def kv_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of the model's attention."""
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, head_dim


def layer_windows(config) -> list[int]:
    """Each layer's sliding window (0: it attends to the whole context), as transformers applies it:
    a query at position p sees keys p-window+1 .. p. The layers `layer_types` names sliding (Qwen2,
    Qwen3, Gemma 3), or every layer where the config has a window and no layer types (Mistral, Phi-3)."""
    layers = config.num_hidden_layers
    window = int(getattr(config, "sliding_window", None) or 0)
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        return [window if kind == "sliding_attention" else 0 for kind in kinds[:layers]]
    if getattr(config, "use_sliding_window", True) is False:
        return [0] * layers
    return [window] * layers


def blocks_for_bytes(model: torch.nn.Module, dtype: torch.dtype, block_size: int, budget_bytes: int) -> int:
    layers, kv_heads, head_dim = kv_shape(model)
    per_block = 2 * layers * block_size * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
    return max(1, budget_bytes // per_block)


class PagedRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, num_blocks: int, block_size: int,
                 kernels: ModuleType | None = None, graph_batch: int = 0, deterministic: bool = False,
                 matmul_rows: int | None = None, fuse: bool = True):
        """Builds the forward worker/model/forward_plan.py chooses (`self.plan`). `deterministic`:
        every token computed alone, whatever else the step holds (below). `matmul_rows`: from how
        many rows a call of a projection on panels runs on oneDNN's matmul instead (Weight); None:
        AMX_MATMUL_ROWS for bf16 on a CPU with AMX, else never. `fuse`: False runs the modules' own
        projections, step by step (the reference path, for tests)."""
        if not supports(model):
            raise ValueError(f"no paged runner for model_type={model.config.model_type!r}; "
                             f"supported: {sorted(SUPPORTED)}")
        self.model = model
        self.vocab_size = quant_model.vocab_size(model)  # the logits' width
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        plan = self.plan = choose(model, device, kernels=kernels is not None, graph_batch=graph_batch,
                                  deterministic=deterministic, matmul_rows=matmul_rows, fuse=fuse)
        layers, self.kv_heads, self.head_dim = kv_shape(model)
        dtype = next(model.parameters()).dtype
        self.context_length = served_context(model.config.to_dict())
        # Sliding-window layers attend to the last `window` keys only: the paged kernel skips the
        # rest, the gathered groups mask them. The cache still holds every position.
        self.windows = layer_windows(model.config)
        self.window = max(self.windows)  # one window per model: the config's sliding_window
        # Head-major: one head's keys of a block are contiguous, so a gather of a sequence's blocks
        # gives each (sequence, head) its [context, head_dim] matrix in one piece for the matmuls.
        # Decode graphs pad their batch with rows that write to one more block, never handed out.
        shape = (layers, self.kv_heads, num_blocks + plan.graphs, block_size, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        # The CPU step kernels (worker/model/kernels.py) run the fused layers' norms, rotary, cache
        # writes and short-chunk attention where the plan has them.
        self.kernels = kernels if plan.kernels else None
        # Every projection and the LM head run on the kernels' panel_linear where this CPU has it
        # for the dtype (Weight decides). AVX-512 (bf16: AVX512-BF16): 1.2-1.9x oneDNN's prepacked
        # matmul per step at 1 to 64 rows, on par at prefill sizes (docs/engine.md); AVX2, fp32 only:
        # 1.2-2x at one or two rows, on par (within the noise of a shared machine) from 4 rows up.
        # The fused weights come after the cache: made first, one-stream bf16 decoding measured
        # 5 % slower (benchmarks/engine.py single, interleaved rounds); the pages' placement, not understood.
        self.fused = self._fuse(dtype, plan.matmul_rows, plan.tile) if plan.fused else None
        self.adapters = None  # the LoRA adapters served (worker/model/lora.py Adapters), set by the worker where any
        # The whole layer stack in one kernel call, for a step of one token, where every projection
        # has a kernel form.
        self.one_token = self._one_token_layers() if self.kernels is not None and self.arch == "llama" else None
        # On CUDA, decode steps replay CUDA graphs (worker/model/cuda_graphs.py); on a CPU the same
        # static-buffer step runs eagerly, which only the tests ask for.
        self.graphs = DecodeGraphs(self, graph_batch, num_blocks) if plan.graphs else None

    # What the plan chose, read from it (self.plan is the one record of it).
    arch = property(lambda self: self.plan.arch)
    matmul_rows = property(lambda self: self.plan.matmul_rows)
    deterministic = property(lambda self: self.plan.deterministic)

    def _fuse(self, dtype: torch.dtype, matmul_rows: int, tile: int) -> list:
        """The fused layers' weights, and the head's (the panels or packed codes of the kernels
        where they run); a quantized tied embedding reads the head's table. Deterministic mode
        (`tile`): a token's result depends on its own sequence only. Every chunk attends through
        the paged kernel (as it does without the mode), and every projection computes each row
        alone: panel_linear or the quantized kernels (as without the mode, but for bf16 on a CPU
        with AMX, whose calls of many rows go to oneDNN otherwise: the plan's matmul_rows is 0),
        or the library's matmul in fixed tiles where the CPU has no panels for the dtype."""
        model = self.model
        fused = fuse(model, self.device, self.kernels, matmul_rows, tile)
        head = quant_model.quantized(model.lm_head) or model.lm_head.weight.data
        self.lm_head = Weight(head, getattr(model.lm_head, "bias", None), self.device, self.kernels, matmul_rows,
                              tile)
        quant_model.install_embedding(model, dtype, self.lm_head.quant)
        first = model.model.layers[0]  # every layer's norm epsilon and attention scale are the first's
        self.eps = getattr(first.input_layernorm, "variance_epsilon", None)
        self.scale = getattr(first.self_attn, "scaling", self.head_dim ** -0.5)
        return fused

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
        if self.kernels is None or self.arch != "llama" or self.fused is None:
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
        layers, heads, _, size, dim = self.k_cache.shape
        return 2 * layers * heads * size * dim * self.k_cache.element_size()

    def read_block(self, block_id: int) -> bytes:
        """One cache block's keys then values, every layer, as the cache holds them."""
        kv = torch.stack((self.k_cache[:, :, block_id], self.v_cache[:, :, block_id])).cpu()
        return kv.view(torch.uint8).numpy().tobytes()

    def write_block(self, block_id: int, data: bytes | memoryview) -> None:
        """Put `data` (read_block's form) in cache block `block_id`."""
        layers, heads, _, size, dim = self.k_cache.shape
        kv = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.k_cache.dtype)
        kv = kv.view(2, layers, heads, size, dim).to(self.device)
        self.k_cache[:, :, block_id] = kv[0]
        self.v_cache[:, :, block_id] = kv[1]

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

    def _one_token_layers(self):
        """The kernels' Layers, or None where a projection runs in Python only (quantized, portable)
        or in tiles (deterministic mode without panels: the stack would call the library's matmul on one row)."""
        ops, layers = self.kernels, self.fused
        if any(w.tile for w in self.projections()):
            return None
        args = {name: [getattr(w, name).projection(ops) for w in layers] for name in ("qkv", "o", "gate_up", "down")}
        if any(p is None for projections in args.values() for p in projections):
            return None
        return ops.Layers([w.ln1 for w in layers], [w.ln2 for w in layers], args["qkv"], args["o"], args["gate_up"],
                          args["down"], self.windows, self.model.config.num_attention_heads, self.kv_heads, self.eps,
                          self.scale)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, hidden: bool = False) -> torch.Tensor:
        """Run the step's chunks; return the logits the chunks need (Chunk.num_logits each: a
        sampling chunk's last token, and one row per proposed token), in chunk order; with
        `hidden`, those tokens' final hidden states instead (pooling: embeddings)."""
        # CUDA graphs and the one-token layer stack add no deltas: a step with adapter rows runs per layer.
        lora = StepLora.of(out.chunks, self.adapters, self.device) if self.adapters is not None else None
        if not hidden and lora is None and self.graphs is not None and self.graphs.fits(out):
            return self.graphs.execute(out)
        step = self._prepare(out)
        step.lora = lora
        step.hidden = hidden
        if self.arch == "opt":
            return self._opt(step)
        if self.arch == "gemma3":
            return self._gemma3(step)
        if self.fused is None:
            return self._llama(step)
        if self.kernels is None:
            return self.fused_forward(step)
        return self._llama_kernels(step)

    # -- inputs ----------------------------------------------------------------------------
    def _prepare(self, out: SchedulerOutput) -> StepInputs:
        bs = self.block_size
        ids, positions, slots, logits_index = [], [], [], []
        groups: dict[int, list] = {}
        for chunk in out.chunks:
            first = len(ids)
            span = range(chunk.start, chunk.start + chunk.length)
            ids += chunk.input_ids
            positions += span
            slots += [chunk.block_table[p // bs] * bs + p % bs for p in span]
            groups.setdefault(_size_class(chunk.length), []).append((first, chunk))
            logits_index += range(len(ids) - chunk.num_logits, len(ids))
        total = len(ids)
        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)
        paged = None
        if self.kernels is not None and self.fused is not None:  # the path execute() takes
            # Every chunk attends through the paged kernel, whose result for a token depends on its
            # own sequence only (worker/model/csrc/paged_attention.cpp): a decode, a prefill chunk of any
            # length, a cached prefix and a failover's replay give a token the same bits.
            paged = self._paged([m for size in sorted(groups) for m in groups.pop(size)], out.chunks)
        return StepInputs(tensor(ids), tensor(positions), tensor(slots),
                     [self._group(groups[size], total) for size in sorted(groups)], tensor(logits_index), paged)

    def _paged(self, members: list, chunks: list) -> Paged:
        bs = self.block_size
        row_of = {id(chunk): row for row, chunk in enumerate(chunks)}
        width = max((-(-(c.start + c.length) // bs) for c in chunks), default=1)
        tables = [c.block_table[:width] + [0] * (width - min(width, len(c.block_table))) for c in chunks]
        tokens, rows, context = [], [], []
        for first, chunk in members:
            row = row_of[id(chunk)]
            tokens += range(first, first + chunk.length)
            rows += [row] * chunk.length
            context += range(chunk.start + 1, chunk.start + chunk.length + 1)
        def tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long)
        return Paged(tensor(tokens), tensor(rows), tensor(context), tensor(tables))

    def _group(self, members: list, total: int) -> AttentionGroup:
        dev, bs = self.device, self.block_size
        width = max(c.length for _, c in members)
        nblocks = max(-(-(c.start + c.length) // bs) for _, c in members)
        first = torch.tensor([f for f, _ in members])
        start = torch.tensor([c.start for _, c in members])
        length = torch.tensor([c.length for _, c in members])
        blocks = torch.zeros((len(members), nblocks), dtype=torch.long)
        for row, (_, chunk) in enumerate(members):
            table = chunk.block_table[:nblocks]
            blocks[row, :len(table)] = torch.tensor(table, dtype=torch.long)
        q = torch.arange(width)
        real = q[None, :] < length[:, None]  # [S, Q]: a query of the chunk, not padding
        # Query q (at position start + q) sees keys 0 .. start + q: causal within the chunk.
        keys, position = torch.arange(nblocks * bs)[None, None, :], (start[:, None] + q[None, :])[:, :, None]
        masks = [keys <= position]
        if 0 < self.window < nblocks * bs:  # the sliding-window layers' mask: keys position-window+1 .. position
            masks.append(masks[0] & (keys > position - self.window))
        for m in masks:
            m &= real[:, :, None]
            m[:, :, 0] |= ~real  # padded queries attend somewhere, to stay finite; dropped later
        masks = [m[:, None].to(dev) for m in masks]
        mask, windowed = masks[0], masks[-1]
        tokens = (first[:, None] + q[None, :])[real]
        blocks, span = blocks.flatten().to(dev), nblocks * bs
        if width == 1:
            return AttentionGroup(tokens.to(dev), None, None, blocks, span, mask, windowed)
        query_index = torch.where(real, first[:, None] + q[None, :], total)
        unpad = (torch.arange(len(members))[:, None] * width + q[None, :])[real]
        return AttentionGroup(tokens.to(dev), query_index.to(dev), unpad.to(dev), blocks, span, mask, windowed)

    # -- attention -------------------------------------------------------------------------
    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepInputs,
                scale: float) -> torch.Tensor:
        """Write this step's k, v to the cache, then attend each group. q: [T, H, D]."""
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        k_cache.view(self.kv_heads, -1, self.head_dim).index_copy_(1, step.slots, k.transpose(0, 1))
        v_cache.view(self.kv_heads, -1, self.head_dim).index_copy_(1, step.slots, v.transpose(0, 1))
        out = torch.empty_like(q)
        self._attend_groups(layer, q, step.groups, scale, out)
        return out

    def _attend_groups(self, layer: int, q: torch.Tensor, groups: list[AttentionGroup], scale: float,
                       out: torch.Tensor) -> None:
        """Attend each group of chunks over keys gathered from the cache; results into out."""
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        q_ext = None
        for g in groups:
            mask = g.windowed if self.windows[layer] and g.windowed is not None else g.mask
            if g.query_index is None:  # one query per chunk (decodes): no padding to add or drop
                qg = q[g.tokens][:, :, None]  # [S, H, 1, D]
            else:
                if q_ext is None:
                    q_ext = torch.cat([q, q.new_zeros((1,) + q.shape[1:])])
                qg = q_ext[g.query_index].transpose(1, 2)  # [S, H, Q, D]
            # Whole blocks at once: [Hkv, S * B, bs, D] -> [S, Hkv, B * bs, D].
            kg = k_cache.index_select(1, g.blocks).view(self.kv_heads, -1, g.span, self.head_dim).transpose(0, 1)
            vg = v_cache.index_select(1, g.blocks).view(self.kv_heads, -1, g.span, self.head_dim).transpose(0, 1)
            if g.query_index is None:
                og = _decode_attention(qg, kg, vg, mask, scale)
            else:
                og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale,
                                                    enable_gqa=qg.shape[1] != kg.shape[1])
            og = og.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])  # [S*Q, H, D]
            out[g.tokens] = og if g.unpad is None else og[g.unpad]

    # -- architectures ---------------------------------------------------------------------
    def _llama(self, step: StepInputs) -> torch.Tensor:
        core = self.model.model
        h = core.embed_tokens(step.input_ids)
        cos, sin = core.rotary_emb(h[None], step.positions[None])
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]  # [T, 1, D]
        total, lora = h.shape[0], step.lora or StepLora([])  # no groups: the modules alone
        for i, layer in enumerate(core.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = lora.project(i, "q_proj", attn.q_proj, x).view(total, -1, self.head_dim)
            k = lora.project(i, "k_proj", attn.k_proj, x).view(total, -1, self.head_dim)
            v = lora.project(i, "v_proj", attn.v_proj, x).view(total, -1, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3 normalises q and k per head
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            o = self._attend(i, q, k, v, step, getattr(attn, "scaling", self.head_dim ** -0.5))
            h = h + lora.project(i, "o_proj", attn.o_proj, o.reshape(total, -1))
            h = h + lora.mlp(i, layer.mlp, layer.post_attention_layernorm(h))
        return self._head(core.norm(h[step.logits_index]), step, self.model.lm_head)

    def fused_forward(self, step: StepInputs) -> torch.Tensor:
        """A llama-family step on the fused projections (what worker/model/cuda_graphs.py captures)."""
        core = self.model.model
        h = core.embed_tokens(step.input_ids)
        cos, sin = core.rotary_emb(h[None], step.positions[None])
        cos, sin = cos[0][:, None, :], sin[0][:, None, :]  # [T, 1, D]
        eps, scale = self.eps, self.scale
        heads = self.model.config.num_attention_heads
        for i, w in enumerate(self.fused if step.lora is None else step.lora.layers(self.fused)):
            q, k, v = before_attention(h, w, cos, sin, eps, heads, self.kv_heads, self.head_dim)
            o = self._attend(i, q, k, v, step, scale)
            h = after_attention(h, o, w, eps)
        return self._head(core.norm(h[step.logits_index]), step, self.lm_head)

    def _llama_kernels(self, step: StepInputs) -> torch.Tensor:
        """The fused layers with the CPU step kernels: per layer four matmuls and five calls."""
        core, ops, paged = self.model.model, self.kernels, step.paged
        h = core.embed_tokens(step.input_ids)
        cos, sin = core.rotary_emb(h[None], step.positions[None])
        cos, sin = cos[0].contiguous(), sin[0].contiguous()  # [T, D]
        eps, scale = self.eps, self.scale
        heads, total = self.model.config.num_attention_heads, h.shape[0]
        # One stream decoding: the layers in one call (which adds no LoRA deltas).
        if total == 1 and self.one_token is not None and step.lora is None and not float_activations_on():
            h = self.one_token.run(h, cos, sin, step.slots, self.k_cache, self.v_cache, paged.tokens, paged.rows,
                                   paged.context, paged.tables)
            return self._head(ops.add_rms_norm(h[step.logits_index], None, core.norm.weight.data,
                                               core.norm.variance_epsilon), step, self.lm_head)
        y = None
        for i, w in enumerate(self.fused if step.lora is None else step.lora.layers(self.fused)):
            k_cache, v_cache = self.k_cache[i], self.v_cache[i]
            x = ops.add_rms_norm(h, y, w.ln1, eps)  # h += y (the last layer's MLP), then the norm
            q = ops.rope_cache(w.qkv(x), cos, sin, step.slots, k_cache.view(self.kv_heads, -1, self.head_dim),
                               v_cache.view(self.kv_heads, -1, self.head_dim), heads, self.kv_heads)
            o = torch.empty_like(q)
            ops.paged_attention(q, o, paged.tokens, paged.rows, paged.context, paged.tables, k_cache, v_cache, scale,
                                self.windows[i])
            self._attend_groups(i, q, step.groups, scale, o)
            x = ops.add_rms_norm(h, w.o(o.view(total, -1)), w.ln2, eps)
            gate, up = w.gate_up(x).chunk(2, dim=-1)
            y = w.down(F.silu(gate) * up)
        h = (h + y)[step.logits_index]
        return self._head(ops.add_rms_norm(h, None, core.norm.weight.data, core.norm.variance_epsilon), step,
                          self.lm_head)

    def _gemma3(self, step: StepInputs) -> torch.Tensor:
        """Gemma 3 on the fused projections (float on the kernels' panels, or kept quantized), with
        its modules' own norms: embeddings scaled, q and k normalised per head, a norm after the
        attention and after the MLP as well as before each, local layers (the sliding window, their
        own rotary base) between global ones, and optionally softcapped logits. With the CPU
        kernels, every chunk attends through the paged kernel, as the llama layers' do."""
        core, config, paged = self.model.model, self.model.config, step.paged
        h = core.embed_tokens(step.input_ids)
        total, heads = h.shape[0], config.num_attention_heads
        sizes = [heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]
        rotary = {}
        for kind in set(config.layer_types):
            cos, sin = core.rotary_emb(h[None], step.positions[None], kind)
            rotary[kind] = cos[0][:, None, :], sin[0][:, None, :]  # [T, 1, D]
        for i, (layer, w) in enumerate(zip(core.layers, self.fused)):
            attn = layer.self_attn
            cos, sin = rotary[config.layer_types[i]]
            q, k, v = w.qkv(layer.input_layernorm(h)).split(sizes, dim=-1)
            q = attn.q_norm(q.reshape(total, heads, self.head_dim))
            k = attn.k_norm(k.reshape(total, self.kv_heads, self.head_dim))
            q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            o = self._attend(i, q, k, v.reshape(total, self.kv_heads, self.head_dim), step, attn.scaling)
            if paged is not None:
                self.kernels.paged_attention(q, o, paged.tokens, paged.rows, paged.context, paged.tables,
                                             self.k_cache[i], self.v_cache[i], attn.scaling, self.windows[i])
            h = h + layer.post_attention_layernorm(w.o(o.view(total, -1)))
            gate, up = w.gate_up(layer.pre_feedforward_layernorm(h)).chunk(2, dim=-1)
            h = h + layer.post_feedforward_layernorm(w.down(layer.mlp.act_fn(gate) * up))
        h = core.norm(h[step.logits_index])
        if step.hidden:
            return h
        logits = self.lm_head(h)
        cap = config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _opt(self, step: StepInputs) -> torch.Tensor:
        dec = self.model.model.decoder
        h = dec.embed_tokens(step.input_ids)
        if getattr(dec, "project_in", None) is not None:
            h = dec.project_in(h)
        h = h + dec.embed_positions.weight[step.positions + dec.embed_positions.offset]
        total = h.shape[0]
        for i, layer in enumerate(dec.layers):
            attn, before = layer.self_attn, layer.do_layer_norm_before
            x = layer.self_attn_layer_norm(h) if before else h
            q = attn.q_proj(x).view(total, -1, self.head_dim)
            k = attn.k_proj(x).view(total, -1, self.head_dim)
            v = attn.v_proj(x).view(total, -1, self.head_dim)
            o = self._attend(i, q, k, v, step, getattr(attn, "scaling", self.head_dim ** -0.5))
            h = h + attn.out_proj(o.reshape(total, -1))
            if not before:
                h = layer.self_attn_layer_norm(h)
            x = layer.final_layer_norm(h) if before else h
            h = h + layer.fc2(layer.activation_fn(layer.fc1(x)))
            if not before:
                h = layer.final_layer_norm(h)
        h = h[step.logits_index]
        if getattr(dec, "final_layer_norm", None) is not None:
            h = dec.final_layer_norm(h)
        if getattr(dec, "project_out", None) is not None:
            h = dec.project_out(h)
        return self._head(h, step, self.model.lm_head)

    @staticmethod
    def _head(h: torch.Tensor, step: StepInputs, head) -> torch.Tensor:
        """The step's result from its final hidden states `h`: they themselves where the step
        asks for them (pooling), else the logits of `head`."""
        return h if step.hidden else head(h)


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """One query per sequence, as two batched matmuls: q [S, H, 1, D], k and v [S, Hkv, L, D].

    The CPU's fused attention kernel spent ~1 ms a layer here (it tiles for long queries); the
    query heads that share a kv head form the rows of one small matmul instead."""
    seqs, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    q = q.reshape(seqs, kv_heads, heads // kv_heads, dim)  # heads of one kv head are adjacent
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [S, Hkv, G, L]
    scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(seqs, heads, 1, dim)


def _size_class(length: int) -> int:
    """Chunks attend in groups of like length, so few queries are padding: decodes (1), short
    chunks (speculative verifies, prompt tails: up to 32) and longer prefill chunks."""
    return 0 if length == 1 else 1 if length <= 32 else 2
