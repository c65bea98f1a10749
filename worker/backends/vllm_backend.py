"""The vLLM backend: vLLM's async engine (AsyncLLM) behind the worker's Backend (worker/engine/backend.py).

vLLM is imported only here, and only when `backend=vllm` is chosen; it lives in its own
virtualenv (`make vllm-env`), since its pins differ from the project's. Everything around the
model stays streamq's: intake, publishing, heartbeats, cancellation, failover. Text is streamq's
too: vLLM returns token ids (detokenize=False) and the request's own Sequence turns them into
text, applies stop strings and the length limit, exactly as with the built-in engine. So a
request continued on another worker (prompt plus the tokens already delivered) carries on the
same way whichever backend runs it.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
from pathlib import Path
from typing import Any

from shared.messages import FinishReason, RequestPayload, TokenEvent
from shared.prefix_scope import PER_TENANT, PrefixScope
from shared.sampling import SamplingParams
from shared.settings import WorkerSettings
from shared.structured import JSON_LAYOUT
from shared.tokenizer import Tokenizer
from worker.engine.backend import Backend
from worker.engine.execution_plan import ExecutionPlan, vllm_plan
from worker.engine.sequence import Logprobs, Sequence, StepOutput, new_sequence, step_output, token_event

log = logging.getLogger(__name__)

STEP_WAIT_S = 0.05  # step() returns after this long without output, so intake keeps going
BAN = -100.0  # vLLM's strongest logit bias: how ban_tokens is expressed to it


class VllmUnavailable(RuntimeError):
    pass


def sampling_kwargs(params: SamplingParams, max_tokens: int) -> dict[str, Any]:
    """streamq's sampling parameters as vLLM SamplingParams arguments. Stop strings are not
    passed: the request's detokenizer applies them, as with the built-in engine."""
    bias = {int(t): float(b) for t, b in params.logit_bias.items()}
    for processor in params.logits_processors:
        for token in processor.token_ids:
            bias[token] = BAN
    return {
        "n": 1,
        "max_tokens": max_tokens,
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": params.top_p,
        "top_k": max(0, params.top_k),  # vLLM: 0 disables (our -1 and 0 both mean "all")
        "min_p": params.min_p,
        "seed": params.seed,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "logprobs": params.logprobs,
        "logit_bias": bias or None,
        "detokenize": False,
        "structured_outputs": structured_kwargs(params),
    }


def structured_kwargs(params: SamplingParams) -> dict[str, Any] | None:
    """The request's constraint as vLLM's StructuredOutputsParams arguments. vLLM compiles it with
    its `guidance` backend (llguidance, as the built-in engine), and a JSON schema carries our
    layout (`x-guidance`: no free whitespace), so the same request obeys the same grammar on
    either backend."""
    constraint = params.structured_outputs
    if constraint is None:
        return None
    if constraint.after_thought is not None:  # never applied from the first token instead, silently
        raise ValueError("a constraint after a free thought runs on the built-in engine, not on the vLLM backend")
    if constraint.form in ("json_schema", "json_object"):
        schema = constraint.json_schema if constraint.form == "json_schema" else {"type": "object"}
        return {"json": {**schema, "x-guidance": JSON_LAYOUT}}
    return {constraint.form: getattr(constraint, constraint.form)}


def engine_kwargs(settings: WorkerSettings, model_dir: str) -> dict[str, Any]:
    """AsyncEngineArgs for the worker's settings."""
    batching, vllm = settings.batching, settings.vllm
    kwargs: dict[str, Any] = {
        "model": model_dir,
        "tokenizer": model_dir,
        "dtype": settings.step.dtype,
        "max_num_seqs": batching.batch_size,
        "max_num_batched_tokens": max(batching.max_num_batched_tokens, vllm.max_model_len or 0) or None,
        "max_model_len": vllm.max_model_len,
        "gpu_memory_utilization": vllm.gpu_memory_utilization,
        "enforce_eager": vllm.enforce_eager,
        "tensor_parallel_size": vllm.tensor_parallel_size,
        "quantization": vllm.quantization,
        "enable_prefix_caching": settings.cache.prefix_caching,
        "disable_log_stats": True,
    }
    if vllm.speculative_config:
        kwargs["speculative_config"] = vllm.speculative_config
    lora = settings.lora
    if lora.paths or lora.enable:  # vLLM's own LoRA: adapters by request (LoRARequest), batched together
        kwargs.update(enable_lora=True, max_loras=lora.max_loras, max_lora_rank=lora.max_rank)
    return {k: v for k, v in kwargs.items() if v is not None}


def prompt_fields(seq: Sequence, scope: PrefixScope) -> dict[str, Any]:
    """vLLM's prompt of a request: its tokens, salted with its tenant's root where its prefixes are
    its own (vLLM's prefix cache keys a salted prompt's blocks apart from every other salt's)."""
    fields: dict[str, Any] = {"prompt_token_ids": list(seq.token_ids)}
    root = scope.root(seq.tenant)
    if root is not None:
        fields["cache_salt"] = f"{root:032x}"
    return fields


def batch_invariant() -> None:
    """Deterministic mode on vLLM: its batch-invariant mode (VLLM_BATCH_INVARIANT), which vLLM's
    CPU build does not have (its CPU attention backend does not support it)."""
    from vllm.platforms import current_platform  # only with backend=vllm

    if current_platform.is_cpu():
        raise ValueError("deterministic mode: vLLM's CPU build has no batch-invariant mode (VLLM_BATCH_INVARIANT "
                         "needs a GPU attention backend); run the built-in engine (backend=hf), or vLLM on a GPU")
    os.environ["VLLM_BATCH_INVARIANT"] = "1"  # vLLM refuses it at start where its backends cannot


class VllmBackend(Backend):
    pools = False  # embeddings need a vLLM engine of task embed; this one generates
    lora = True  # vLLM's own LoRA, where lora_modules or enable_lora turn it on
    name = "vllm"

    def __init__(self, engine: Any, tokenizer: Tokenizer, batch_size: int, context_length: int,
                 deterministic: bool = False, lora: dict[str, Path] | None = None, scope: PrefixScope = PER_TENANT):
        """`lora`: the adapters of lora_modules where LoRA is on (None: off), name -> folder; `scope`:
        whose cached prefixes a request may reuse (shared/prefix_scope.py)."""
        from vllm import SamplingParams as VllmSamplingParams  # only with backend=vllm
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        self._params_class, self._prompt_class, self._delta = VllmSamplingParams, TokensPrompt, RequestOutputKind.DELTA
        self._structured_class = StructuredOutputsParams
        self.engine = engine
        self.tokenizer = tokenizer
        self.deterministic = deterministic  # vLLM's batch-invariant mode on (a GPU worker only)
        self.batch_size = batch_size
        self.context_length = context_length
        self._last_step_size = 0
        self._active: dict[str, tuple[Sequence, asyncio.Task[None]]] = {}
        self._events: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._configured = lora  # STREAMQ_LORA_MODULES, where LoRA is on
        self._known = dict(lora or {})  # and the adapters loaded at run time: name -> folder
        self._lora_ids: dict[tuple[str, int], int] = {}  # vLLM's id of each adapter load (name, revision), from 1
        self.scope = scope

    @staticmethod
    def require_vllm() -> None:
        """Raise VllmUnavailable, saying how to install it, when vLLM cannot be imported here."""
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise VllmUnavailable(
                f"backend=vllm needs vLLM in this worker's environment ({exc}). Install it with "
                "`pip install .[vllm]` on a GPU machine, or `make vllm-env` (vLLM's CPU build in .venv-vllm) "
                "and run the worker with .venv-vllm/bin/streamq worker.") from exc

    @classmethod
    async def start(cls, settings: WorkerSettings, model_dir: str, tokenizer: Tokenizer) -> VllmBackend:
        cls.require_vllm()
        from vllm import AsyncEngineArgs
        from vllm.config import StructuredOutputsConfig
        from vllm.v1.engine.async_llm import AsyncLLM

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(settings.kv_cache_gb))))
        kwargs = engine_kwargs(settings, model_dir)
        args = AsyncEngineArgs(**kwargs, structured_outputs_config=StructuredOutputsConfig(backend="guidance"))
        log.info("starting vLLM's engine (%s)", ", ".join(f"{k}={v}" for k, v in kwargs.items() if k != "tokenizer"))
        # Construction takes tens of seconds of blocking work: off the event loop.
        engine = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        context = engine.model_config.max_model_len
        lora = settings.lora.paths if settings.lora.paths or settings.lora.enable else None
        return cls(engine, tokenizer, settings.batch_size, context, settings.step.deterministic, lora,
                   PrefixScope.parse(settings.shared_prefix_tenants))

    # -- the Backend -----------------------------------------------------------------------------------------------------------------------------------------------
    def add(self, payload: RequestPayload, resumed: list[TokenEvent] | tuple = ()) -> Sequence:
        seq = new_sequence(payload, self.tokenizer.decode, resumed, self.tokenizer.decode_stream)
        limit = payload.params.max_tokens or self.context_length
        remaining = min(limit - len(seq.output_ids), self.context_length - seq.num_tokens)
        task = asyncio.create_task(self._run(seq, max(1, remaining)), name=f"vllm-{seq.id}")
        self._active[seq.id] = (seq, task)
        return seq

    def cancel(self, request_id: str) -> None:
        if request_id in self._active:
            seq, task = self._active[request_id]
            seq.finish(FinishReason.CANCELLED)
            task.cancel()

    @property
    def free_slots(self) -> int:
        return max(0, self.batch_size - len(self._active))

    @property
    def running(self) -> list[Sequence]:
        return [seq for seq, _ in self._active.values()]

    @property
    def waiting(self) -> list[Sequence]:
        return []  # vLLM keeps its own waiting queue; every request taken here is "running" for us

    @property
    def last_step_size(self) -> int:
        return self._last_step_size

    def has_work(self) -> bool:
        return bool(self._active) or not self._events.empty()

    async def step(self) -> list[StepOutput]:
        try:
            outputs = [await asyncio.wait_for(self._events.get(), STEP_WAIT_S)]
        except TimeoutError:
            return []
        while not self._events.empty():
            outputs.append(self._events.get_nowait())
        self._last_step_size = len({out.request_id for out in outputs})
        return outputs

    def fail_all(self, error: str) -> list[StepOutput]:
        outputs = []
        for seq, task in list(self._active.values()):
            seq.finish(FinishReason.ERROR, error)
            task.cancel()
            outputs.append(step_output(seq, None, True))
        self._active.clear()
        return outputs

    # counts, phase_seconds and kv_blocks are Backend's (none): vLLM keeps its own totals (its prefix
    # cache, preemptions) and phases (its step is one await here), not read here.

    @property
    def batch_invariant(self) -> bool:
        return self.deterministic

    @property
    def plan(self) -> ExecutionPlan:
        from vllm.platforms import current_platform  # only with backend=vllm

        dtype = str(self.engine.model_config.dtype).removeprefix("torch.")
        return vllm_plan(dtype, current_platform.device_type, self.deterministic)

    @property
    def adapters(self) -> list[str] | None:
        return sorted(self._known) if self._configured is not None else None

    def learn_adapters(self, runtime: dict[str, Path]) -> None:
        self._known = {**runtime, **(self._configured or {})}

    def _lora_request(self, seq: Sequence):
        """vLLM's LoRARequest for the request's adapter (None for the base model); a ValueError naming
        it where this worker does not serve it. An adapter loaded at run time runs the load its
        request was claimed with (RequestPayload.adapter_revision): each load its own id and name in
        vLLM, which keys its loaded adapters by them, so a load under a name since runs the new weights."""
        name = seq.adapter
        if name is None:
            return None
        if name not in (self._configured or {}) and seq.adapter_path is not None:
            key, path = (name, seq.adapter_revision or 0), seq.adapter_path
        elif name in self._known:
            key, path = (name, 0), str(self._known[name])
        else:
            raise ValueError(f"adapter {name!r} is not served by this worker (served: {sorted(self._known) or 'none'})")
        from vllm.lora.request import LoRARequest  # only with backend=vllm

        lora_id = self._lora_ids.setdefault(key, len(self._lora_ids) + 1)
        return LoRARequest(name if key[1] == 0 else f"{name}@{key[1]}", lora_id, path)

    async def close(self) -> None:
        for _, task in list(self._active.values()):
            task.cancel()
        await asyncio.to_thread(self.engine.shutdown)

    # -- one request -----------------------------------------------------------------------------
    async def _run(self, seq: Sequence, max_tokens: int) -> None:
        eos, context = self.tokenizer.eos_token_ids, self.context_length
        try:
            kwargs = sampling_kwargs(seq.params, max_tokens)  # a ValueError ends this request only
            if seq.params.thinking_budget is not None:  # the built-in sampler's; never dropped silently
                raise ValueError("a thinking budget runs on the built-in engine, not on the vLLM backend")
            if kwargs["structured_outputs"] is not None:
                if seq.output_ids:  # vLLM's grammar would start at the delivered tokens, not before them
                    raise ValueError("a request with structured_outputs cannot be continued on the vLLM backend")
                kwargs["structured_outputs"] = self._structured_class(**kwargs["structured_outputs"])
            params = self._params_class(output_kind=self._delta, **kwargs)
            async for out in self.engine.generate(self._prompt_class(**prompt_fields(seq, self.scope)), params,
                                                  seq.id, lora_request=self._lora_request(seq)):
                completion = out.outputs[0]
                for i, token in enumerate(completion.token_ids):
                    text = seq.accept(token, eos, context)
                    lp = (_logprobs(completion.logprobs[i], token, seq.params.logprobs or 0)
                          if completion.logprobs else None)
                    self._events.put_nowait(step_output(seq, token_event(seq, token, text, lp), seq.finished))
                    if seq.finished:  # a stop string, or our limit: vLLM need not go on
                        await self.engine.abort(seq.id)
                        return
                if out.finished:  # vLLM ended it first (its eos, or a limit of its own)
                    seq.finish(FinishReason.STOP if completion.finish_reason == "stop" else FinishReason.LENGTH)
                    seq.detokenizer.flush()
                    self._events.put_nowait(step_output(seq, None, True))
                    return
        except asyncio.CancelledError:
            await asyncio.shield(self.engine.abort(seq.id))
            if seq.finish_reason is FinishReason.CANCELLED:
                self._events.put_nowait(step_output(seq, None, True))
            raise
        except Exception as exc:  # one request's failure ends that request only
            log.exception("vLLM failed request %s", seq.id)
            seq.finish(FinishReason.ERROR, f"vLLM: {type(exc).__name__}: {exc}")
            self._events.put_nowait(step_output(seq, None, True))
        finally:
            self._active.pop(seq.id, None)


def _logprobs(entry: dict[int, Any], chosen: int, k: int) -> Logprobs:
    """vLLM's {token id: Logprob(logprob, rank)} of one position (the chosen token, plus the k
    most likely) as streamq's: the chosen token's log-probability, the k most likely first."""
    ranked = sorted(((lp.rank, token, float(lp.logprob)) for token, lp in entry.items() if 1 <= lp.rank <= k))
    return Logprobs(float(entry[chosen].logprob), [(token, logprob) for _, token, logprob in ranked])
