"""The static-batch engine: the slower path for architectures the paged runner lacks.

A batch is formed from the waiting requests when the previous one has drained; its rows
share one transformers KV cache (BatchRunner, below). A finished or cancelled row stops
producing tokens at once; its slot is reused when the batch drains. Llama-family and OPT
models use the continuous engine (worker/engine/core.py) instead.
"""
from __future__ import annotations

import inspect
from collections import deque

import torch
from transformers import DynamicCache

from shared.messages import FinishReason, RequestPayload, TokenEvent, now
from shared.tokenizer import Tokenizer, served_context
from worker.engine.base import BaseEngine
from worker.engine.execution_plan import ExecutionPlan, static_plan
from worker.engine.random_streams import make_generator, replay_draws
from worker.engine.vision import processor_inputs
from worker.engine.sampler import SamplingBatch, SamplingRow, sample_each
from worker.engine.sequence import Sequence, StepOutput, new_sequence, step_output
from worker.engine.structured import GrammarError, Grammars


class StaticEngine(BaseEngine):
    def __init__(self, runner: BatchRunner, tokenizer: Tokenizer, batch_size: int, image_processor=None):
        """`image_processor`: a vision-language model's (transformers'), which turns a request's
        images into the pixels its prefill takes (None: a text model)."""
        super().__init__(batch_size)
        self.runner = runner
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.waiting: deque[Sequence] = deque()
        self.rows: list[Sequence] = []  # the current batch, finished rows included
        self._sampling: dict[str, SamplingRow] = {}
        self.grammars = Grammars(tokenizer, runner.vocab_size)
        self._refused: list[StepOutput] = []  # ended at scheduling (a constraint that does not compile)

    # -- called from the asyncio side ------------------------------------------------------
    def add(self, payload: RequestPayload, resumed: list[TokenEvent] | tuple = (), images: list[bytes] = ()
            ) -> Sequence:
        seq = new_sequence(payload, self.tokenizer.decode, resumed, self.tokenizer.decode_stream)
        seq.images = list(images)
        self.waiting.append(seq)
        return seq

    @property
    def takes_images(self) -> bool:
        return self.image_processor is not None

    def _pixels(self, rows: list[Sequence]) -> dict[str, torch.Tensor] | None:
        """The rows' images as the model's processor gives them, in row order (None: no images).
        Decoded here, in the model thread: the api checked every one already."""
        images = [image for seq in rows for image in seq.images]
        if not images:
            return None
        return processor_inputs(self.image_processor, images, self.runner.device,
                            next(self.runner.model.parameters()).dtype)

    @property
    def free_slots(self) -> int:
        """How many requests the engine can take now: a whole batch once the last one drained."""
        return 0 if self.running or self.waiting else self.batch_size

    @property
    def running(self) -> list[Sequence]:
        return [s for s in self.rows if not s.finished]

    @property
    def plan(self) -> ExecutionPlan:
        return static_plan(str(next(self.runner.model.parameters()).dtype), str(self.runner.device))

    # -- one step, run in the model thread -------------------------------------------------
    def step(self) -> list[StepOutput]:
        outputs = self._end_cancelled()
        started = self._schedule()
        outputs, self._refused = outputs + self._refused, []
        self.last_step_size = len(self.running)
        if self.running:
            logits = self._execute(started)
            outputs += self._update(logits)
        if self.rows and not self.running:
            self.rows = []
            self.runner.release()
        return outputs

    def _running_or_waiting(self) -> list[Sequence]:
        return self.running + list(self.waiting)

    def _forget(self, seq: Sequence) -> None:
        self._sampling.pop(seq.id, None)  # a finished row keeps its slot until the batch drains
        if seq in self.waiting:
            self.waiting.remove(seq)

    def _reset(self) -> None:
        self.rows, self.waiting = [], deque()
        self.runner.release()

    def _schedule(self) -> bool:
        """Start a new batch if the last one drained; True if one started."""
        if self.rows or not self.waiting:
            return False
        while self.waiting and len(self.rows) < self.batch_size:
            seq = self.waiting.popleft()
            seq.scheduled_at = now()
            try:
                matcher = self.grammars.matcher(seq.params, seq.output_ids)
            except GrammarError as exc:
                seq.finish(FinishReason.ERROR, str(exc))
                self._refused.append(step_output(seq, None, True))
                continue
            generator = make_generator(seq.params, self.runner.device)
            replay_draws(generator, self.runner.vocab_size, len(seq.output_ids))  # tokens delivered before a failover
            self._sampling[seq.id] = SamplingRow.of(seq, generator, matcher)
            self.rows.append(seq)
        return bool(self.rows)

    def _execute(self, new_batch: bool) -> torch.Tensor:
        if new_batch:
            return self.runner.prefill([s.token_ids for s in self.rows], self._pixels(self.rows))
        pad = self.runner.pad_id
        return self.runner.decode([s.output_ids[-1] if s.output_ids else pad for s in self.rows])

    def _update(self, logits: torch.Tensor) -> list[StepOutput]:
        rows = [(row, seq) for row, seq in enumerate(self.rows) if not seq.finished]
        seqs = [seq for _, seq in rows]
        picked = sample_each(logits[[row for row, _ in rows]], SamplingBatch([self._sampling[s.id] for s in seqs]))
        outputs = []
        for seq, result in zip(seqs, picked):
            if isinstance(result, Exception):  # its own parameters broke its sampling: it alone fails
                outputs.append(self._sampling_failed(seq, result))
                continue
            ([token], [lp]) = result
            outputs.append(self._emit(seq, token, lp))
        return outputs


class BatchRunner:
    """Forward passes over one batch of rows that share a KV cache."""

    def __init__(self, model: torch.nn.Module, device: torch.device, pad_id: int = 0):
        self.model = model
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])  # the logits' width
        self.device = device
        self.pad_id = pad_id
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed past_key_values to cache
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None
        self._next_pos: torch.Tensor | None = None
        # M-RoPE (Qwen2-VL): positions in (time, height, width), an image's by its grid, the text's
        # after it by each row's offset (`_deltas`), as the model's get_rope_index gives them.
        inner = getattr(model, "model", None)
        self._rope_index = getattr(inner, "get_rope_index", None)
        self._image_token = getattr(model.config, "image_token_id", None)
        self._deltas: torch.Tensor | None = None
        # Gemma 3: an image's tokens attend to each other both ways in the prefill (its token types)
        self._image_types = model.config.model_type == "gemma3"

    @property
    def context_length(self) -> int:
        return served_context(self.model.config.to_dict())

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], images: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Start a new batch; return the logits of each prompt's last position, [rows, vocab].
        `images`: a vision-language model's (pixel_values and what else its processor gives), in the
        order of their tokens in the rows."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        self._cache = DynamicCache(config=self.model.config)
        self._mask = mask
        self._next_pos = positions[:, -1] + 1
        types = ((ids == self._image_token) & mask.bool()).long() if self._image_token is not None else None
        if self._rope_index is not None:
            grid = (images or {}).get("image_grid_thw")
            positions, self._deltas = self._rope_index(ids, types.int(), image_grid_thw=grid, attention_mask=mask)
        if self._image_types:
            images = {**(images or {}), "token_type_ids": types}
        return self._forward(ids, positions, images)

    @torch.inference_mode()
    def decode(self, tokens: list[int]) -> torch.Tensor:
        """Feed one new token per row; return next-token logits, [rows, vocab]."""
        assert self._cache is not None and self._mask is not None and self._next_pos is not None
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device).unsqueeze(1)
        self._mask = torch.cat([self._mask, torch.ones_like(self._mask[:, :1])], dim=1)
        positions = self._next_pos.unsqueeze(1)
        self._next_pos = self._next_pos + 1
        if self._deltas is not None:  # M-RoPE: the three axes alike after the prompt, each row by its offset
            positions = (positions + self._deltas.to(positions.device)).unsqueeze(0).expand(3, -1, -1)
        return self._forward(ids, positions)

    def release(self) -> None:
        """Free the batch's KV cache."""
        self._cache = self._mask = self._next_pos = self._deltas = None

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, images: dict[str, torch.Tensor] | None = None
                 ) -> torch.Tensor:
        extra = images or {}
        out = self.model(input_ids=ids, attention_mask=self._mask, position_ids=positions,
                         use_cache=True, logits_to_keep=1, **{self._cache_arg: self._cache}, **extra)
        return out.logits[:, -1, :]
