"""What every endpoint family shares: turn a prompt into a queued request, follow the events
of one or several requests, cancel them. The native, OpenAI and seed-tutorial routes differ
only in the shapes they accept and answer.

A route comes here once its caller is admitted (api/core/auth.admitted: the key, then the
tenant's limits), so the CPU work of a request, its prompt tokenized and templated in the
tokenize pool and its constraint compiled in the grammar pool, is done only for a request that
may run, and never on the event loop."""
from __future__ import annotations

import asyncio
import base64
import copy
import logging
import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar
from collections.abc import AsyncIterator, Callable

from opentelemetry import trace

from api.core import grammar_pool, images, tokenize_pool
from api.core.backpressure import Backpressure
from api.core.choice import Choice
from api.core.errors import ApiError
from api.core.grammar_pool import GrammarPool
from api.core.limits import Limits
from api.core.parsers import registry
from api.core.parsers.reasoning import CLOSE, OPEN, ThinkFormat
from api.core.parsers.harmony import harmony_budget
from api.core.parsers.base import ToolFormat
from api.core.relay import Event, Relay
from api.core.tokenize_pool import TokenizePool
from shared import redis_keys, service_tier, tracing
from shared.ids import request_id
from shared.lora_registry import LoraRegistry
from shared.messages import FinalEvent, RequestPayload, TokenEvent, now
from shared.prefix_affinity import PrefixAffinity
from shared.sampling import SamplingParams, ThinkingBudget
from shared.store import RequestStore
from shared.structured import StructuredOutputs, ThoughtPrefix
from shared.tokenizer import ChatTemplateError, Tokenizer
from shared.heartbeat import Heartbeat
from shared.workers import live_workers


log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Prompt:
    """What a request asks the model to run, read from its protocol's body (`ChatRequest.as_prompt`,
    `CompletionRequest.as_prompt`) and checked against the model by `Generation.payloads`: the
    prompt (a chat's messages with the tools a chat template renders itself, a text, or token ids)
    and one SamplingParams per sample."""

    model: str | None  # the model the body names (None: the one it was sent to)
    samples: list[SamplingParams]
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    priority: int = 0
    backend: str | None = None  # run on a worker of this backend only
    tool_format: ToolFormat | None = None  # the replies' tool format, where the request calls tools
    constraint_param: str = "structured_outputs"  # the body's field its samples' constraint came from
    service_tier: str = "auto"  # the tier asked for (Generation.tier resolves it)
    template_kwargs: dict[str, Any] | None = None  # more variables for the chat template (chat_template_kwargs)
    # How its replies' thought is read: set by Generation.payloads for a chat on a thinking model
    reasoning: ThinkFormat | None = None
    thinking_budget: int | None = None  # the thought's most tokens (vLLM's thinking_token_budget)
    thinking_param: str = "thinking_token_budget"  # the body's field it came from
    images: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # its image parts: (where in the body, URL)
    images_param: str = "messages"  # the body's field its images came in (Responses: input)

    @property
    def logprobs(self) -> int | None:
        """The log probabilities each token reports (None: none)."""
        return self.samples[0].logprobs


class Generation:
    def __init__(self, store: RequestStore, relay: Relay, tokenizer: Tokenizer, model_name: str, *,
                 default_max_tokens: int, queue_timeout_s: float = 300.0,
                 flex_queue_timeout_s: float = 900.0, max_tokens_cap: int = 1_000_000,
                 backpressure: Backpressure | None = None, limits: Limits | None = None, log_prompts: bool = False,
                 affinity: PrefixAffinity | None = None, tool_format: ToolFormat | None = None,
                 grammars: GrammarPool | None = None, tokenizing: TokenizePool | None = None,
                 reasoning: ThinkFormat | None = None, image_limits: images.Limits | None = None):
        """`backpressure`: the model's queue limit (none: unlimited); `limits`: the tenants' limits,
        when auth is on; `affinity`: the workers' prefix announcements, when requests go to the
        worker that holds their prompt's prefix; `tool_format`: the format its replies with tool calls
        are read in (api/core/parsers/registry.py; none: the generic one); `grammars`, `tokenizing`:
        the replica's pools for its CPU work (none: pools of this Generation's own, with the defaults);
        `reasoning`: the format of its replies' thought (api/core/parsers/reasoning.py; none: no thought)."""
        self.store = store
        self.relay = relay
        self.tokenizer = tokenizer
        self.model_name = model_name  # what the answers name: the model, or the LoRA adapter asked for
        self.base_model = model_name  # whose queue and workers run it
        self.adapter: str | None = None  # the LoRA adapter its requests run with (with_adapter)
        self.adapter_backends: frozenset[str] = frozenset()  # ... and the backends of the workers serving it
        self.default_max_tokens = default_max_tokens
        self.queue_timeout_s = queue_timeout_s
        self.flex_queue_timeout_s = flex_queue_timeout_s
        self.max_tokens_cap = max_tokens_cap
        self.backpressure = backpressure
        self.limits = limits
        self.log_prompts = log_prompts
        self.affinity = affinity
        self.tool_format = tool_format or registry.get(registry.FALLBACK)
        self.reasoning = reasoning
        self.grammars = grammars or GrammarPool()
        self.tokenizing = tokenizing or TokenizePool()
        self.image_limits = image_limits or images.Limits()

    def with_adapter(self, name: str, backends: set[str]) -> Generation:
        """This model's Generation for requests that run with the LoRA adapter `name`, which workers
        of `backends` serve (the same queue, tokenizer and limits; the answers name the adapter)."""
        view = copy.copy(self)
        view.model_name, view.adapter, view.adapter_backends = name, name, frozenset(backends)
        return view

    async def live_workers(self) -> list[Heartbeat]:
        """The heartbeats of the live workers that serve this model."""
        return [w for w in await live_workers(self.store.redis, self.store.prefix) if w.model == self.base_model]

    async def live_backends(self) -> set[str]:
        """The backends of the live workers that serve this model."""
        return {w.backend for w in await self.live_workers() if w.backend}

    async def check_backend(self, backend: str) -> None:
        """404 unless a live worker of `backend` serves the model (a request for it would wait forever)."""
        live = await self.live_backends()
        if backend not in live:
            raise ApiError(404, f"no live worker of backend {backend!r} serves {self.base_model!r}; "
                                f"live backends: {sorted(live)}", param="backend", code="backend_not_found")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"model {model!r} is not served here; served models: [{self.model_name!r}]",
                           param="model", code="model_not_found")

    async def encode(self, prompt: str | None = None, messages: list[dict[str, Any]] | None = None,
                     tools: list[dict[str, Any]] | None = None, add_special_tokens: bool | None = None,
                     add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Prompt token ids, in the tokenize pool; `tools`, for a chat template that renders them itself.
        `add_special_tokens`: the tokenizer's own (a BOS) added; by default to a prompt, not to a chat,
        whose template writes them."""
        self.require_generative()
        try:
            if messages is not None:
                return await self.tokenize(self.tokenizer.encode_chat, messages, tools, add_generation_prompt,
                                           bool(add_special_tokens), template_kwargs, param="messages")
            return await self.tokenize(self.tokenizer.encode, prompt, add_special_tokens is not False)
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from exc

    def require_generative(self) -> None:
        """400 for an encoder model (an embedding model or a cross-encoder): it generates no text."""
        if (encoder := self.tokenizer.pooling if self.tokenizer is not None else None) is not None:
            what = "a cross-encoder (/v1/rerank, /v1/score)" if encoder.kind == "classify" \
                else "an embedding model (/v1/embeddings, /v1/rerank, /v1/score)"
            raise ApiError(400, f"{self.model_name!r} is {what}: it generates no text", param="model",
                           code="model_not_generative")

    async def tokenize(self, fn: Callable[..., T], *args: Any, param: str = "prompt") -> T:
        """fn(*args), tokenizer work, in the tokenize pool: 503 where its threads stay busy past the
        time cap, 400 (naming `param`) where the call itself runs past it."""
        try:
            return await self.tokenizing.run(fn, *args)
        except tokenize_pool.PoolBusy as exc:
            raise ApiError(503, f"the server is busy: {exc}; retry shortly", code="overloaded",
                           headers={"Retry-After": "1"}) from exc
        except tokenize_pool.TokenizeTimeout as exc:
            raise ApiError(400, str(exc), param=param) from exc

    async def check_constraint(self, constraint: StructuredOutputs, param: str, tenant: str = "") -> None:
        """Compile the constraint in the grammar pool: 422 (400 on the OpenAI and Anthropic paths)
        naming `param` where it does not compile or its compile runs past the time cap; 503 where
        no compile process comes free within it."""
        try:
            error = await self.grammars.verdict(constraint.model_dump_json(by_alias=True, exclude_none=True), tenant)
        except grammar_pool.PoolBusy as exc:
            raise ApiError(503, f"the server is busy: {exc}; retry shortly", code="overloaded",
                           headers={"Retry-After": "1"}) from exc
        except grammar_pool.CompileFailed as exc:
            error = str(exc)
        if error:
            raise ApiError(422, f"{param}: {error}", param=param)

    async def payloads(self, prompt: Prompt, tenant: str = "", compile: bool = True) -> list[RequestPayload]:
        """The requests a prompt runs, one per sample: checked against the model, their constraint
        compiled (unless not `compile`: a count of its tokens runs nothing), not queued yet (`submit`
        queues them). Asked once `tenant` is admitted, as it tokenizes and compiles."""
        self.check_model(prompt.model)
        tier = await self.tier(tenant, prompt.service_tier)  # a tier it may not use: 403 before any work
        if prompt.token_ids is not None:
            prompt_ids = prompt.token_ids
            if any(not 0 <= t < self.tokenizer.vocab_size for t in prompt_ids):
                raise ApiError(400, "prompt token ids must be within the vocabulary", param="prompt")
        else:
            checked = await self._images(prompt) if prompt.images else []
            prompt_ids = await self.encode(prompt.text, prompt.messages, prompt.tools,
                                           template_kwargs=prompt.template_kwargs)
            if checked:
                try:
                    prompt_ids = self.tokenizer.vision.expand(prompt_ids, [(i.width, i.height) for i in checked])
                except ValueError as exc:
                    raise ApiError(400, str(exc), param=prompt.images_param) from exc
                if len(prompt_ids) > self.tokenizer.context_length:
                    raise ApiError(400, f"the prompt with its images is {len(prompt_ids)} tokens, more than the "
                                        f"model's context of {self.tokenizer.context_length}", param=prompt.images_param)
                if compile:  # it runs (a count of its tokens keeps nothing)
                    await self._keep_images(checked)
            if prompt.messages is not None and self.reasoning is not None:
                prompt.reasoning = self.reasoning_of(prompt_ids)
                prompt.samples = _thought_free(prompt.samples, prompt.reasoning)
            if prompt.thinking_budget is not None:
                await self._budget(prompt)
            if self._keeps_special_tokens(prompt):
                prompt.samples = [p.model_copy(update={"skip_special_tokens": False}) for p in prompt.samples]
        vision = self.tokenizer.vision if self.tokenizer is not None else None
        if vision is not None and not prompt.images and vision.image_token_id in prompt_ids:
            # its tokens would ask the model for images it was not given, and fail the batch it runs in
            raise ApiError(400, "the prompt holds the model's image token without an image: send images as image "
                                "parts, never the token itself", param="prompt" if prompt.messages is None else "messages")
        payloads = [self.build(prompt_ids, params, prompt.priority) for params in prompt.samples]
        if prompt.images:
            for payload in payloads:
                payload.images = [image.sha256 for image in checked]
        for payload in payloads:
            payload.service_tier = tier
            if tier == "flex" and payload.expires_at is not None:  # flex may wait longer in the queue
                payload.expires_at = payload.created_at + self.flex_queue_timeout_s
        if prompt.backend is not None:
            await self.check_backend(prompt.backend)
            for payload in payloads:
                payload.backend = prompt.backend
        constraints = {id(p.structured_outputs): p.structured_outputs for p in prompt.samples
                       if p.structured_outputs is not None}
        for constraint in constraints.values() if compile else ():  # the samples share one: compiled once
            await self.check_constraint(constraint, prompt.constraint_param, tenant)
        return payloads

    async def _images(self, prompt: Prompt) -> list[images.Image]:
        """The prompt's images read and checked (api/core/images.py): a 400 at once where the model
        takes none, before any is decoded."""
        if self.tokenizer.vision is None:
            raise ApiError(400, f"{self.model_name!r} takes no images (a vision-language model does); send text only",
                           param=prompt.images_param)
        return await images.check_all(prompt.images, self.image_limits, prompt.images_param)

    async def _keep_images(self, checked: list[images.Image]) -> None:
        """Each image's bytes in Redis under its sha256, kept IMAGE_TTL_S from now (once however
        many requests send it), for whichever worker runs or takes over the request."""
        async with self.store.redis.pipeline(transaction=False) as pipe:
            for image in {i.sha256: i for i in checked}.values():
                key = redis_keys.image(self.store.prefix, image.sha256)
                pipe.set(key, base64.b64encode(image.data).decode(), ex=redis_keys.IMAGE_TTL_S, nx=True)
                pipe.expire(key, redis_keys.IMAGE_TTL_S)
            await pipe.execute()

    def _keeps_special_tokens(self, prompt: Prompt) -> bool:
        """Whether the reply's text must keep the special tokens the model writes: its tool format
        or its reasoning format marks calls or messages with some (api/core/parsers/base.Markers)."""
        if prompt.messages is None:
            return False
        tools = prompt.tool_format is not None and prompt.tool_format.keeps_special_tokens
        return tools or (self.reasoning is not None and self.reasoning.keeps_special_tokens)

    async def _budget(self, prompt: Prompt) -> None:
        """The thinking budget on the prompt's samples (ThinkingBudget: the sampler closes the
        thought after that many tokens); a 400 where the model does not think aloud or no live
        worker runs the built-in engine (the vLLM backend refuses a budget rather than drop it)."""
        if prompt.reasoning is None:
            raise ApiError(400, f"{prompt.thinking_param}: {self.model_name!r} does not think aloud (no reasoning "
                                "parser reads its replies: STREAMQ_REASONING_PARSER)", param=prompt.thinking_param)
        if not any(w.pools for w in await self.live_workers()):
            raise ApiError(400, f"{prompt.thinking_param} runs on the built-in engine; no live worker of "
                                f"{self.model_name!r} has it", param=prompt.thinking_param)
        if isinstance(prompt.reasoning, ThinkFormat):
            budget = ThinkingBudget(tokens=prompt.thinking_budget,
                                    end=self.tokenizer.encode(CLOSE, add_special_tokens=False))
        else:  # Harmony: a reply that opens on the analysis channel is closed into the next message
            if not prompt.reasoning.keeps_special_tokens:
                raise ApiError(400, f"{prompt.thinking_param}: a budget on Harmony reads its markers as tokens, and this "
                                    "model's tokenizer spells them as text (gpt-oss's own has them as special tokens)",
                               param=prompt.thinking_param)
            start, end = harmony_budget(calls=prompt.tool_format is not None)
            budget = ThinkingBudget(tokens=prompt.thinking_budget, start=self.tokenizer.encode(start, add_special_tokens=False),
                                    end=self.tokenizer.encode(end, add_special_tokens=False))
        prompt.samples = [p.model_copy(update={"thinking_budget": budget}) for p in prompt.samples]

    def reasoning_of(self, prompt_ids: list[int]) -> ThinkFormat:
        """The model's reasoning format for a chat whose prompt is these ids: opened where this
        prompt ends inside a thought (its template opened one; chat_template_kwargs such as
        enable_thinking may have closed it instead)."""
        if not isinstance(self.reasoning, ThinkFormat):  # Harmony's: the model opens every message itself
            return self.reasoning
        tail = self.tokenizer.decode(prompt_ids[-16:], skip_special_tokens=False).rstrip()
        return ThinkFormat(opened=tail.endswith(OPEN))

    def build(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0) -> RequestPayload:
        """Check the request against the model and build what the worker runs."""
        context, n = self.tokenizer.context_length, len(prompt_ids)
        if n == 0:
            raise ApiError(400, "the prompt encodes to no tokens", param="prompt")
        if n >= context:
            raise ApiError(400, f"the prompt has {n} tokens; the model's context is {context} tokens, "
                                "which must also hold at least one generated token", param="prompt")
        self._check_token_ids(params)
        if params.max_tokens is not None and params.max_tokens > self.max_tokens_cap:
            raise ApiError(422, f"max_tokens is {params.max_tokens}; this server allows at most {self.max_tokens_cap}",
                           param="max_tokens")
        if params.max_tokens is None:
            params = params.model_copy(update={"max_tokens": min(self.default_max_tokens, context - n)})
        elif n + params.max_tokens > context:
            raise ApiError(400, f"the prompt has {n} tokens and max_tokens is {params.max_tokens}: together "
                                f"{n + params.max_tokens}, more than the model's context of {context} tokens",
                           param="max_tokens")
        created = now()
        return RequestPayload(id=request_id(), model=self.base_model, prompt_token_ids=prompt_ids,
                              params=params, created_at=created, expires_at=created + self.queue_timeout_s,
                              priority=priority, adapter=self.adapter,
                              # to the one backend that serves the adapter, where another serves the model too
                              backend=next(iter(self.adapter_backends)) if len(self.adapter_backends) == 1 else None)

    def _check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.tokenizer.vocab_size
        named = {"logit_bias": list(params.logit_bias), "stop_token_ids": params.stop_token_ids,
                 "logits_processors": [t for p in params.logits_processors for t in p.token_ids]}
        for field, ids in named.items():
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ApiError(422, f"{field}: token ids {bad[:5]} are outside the vocabulary (0 to {vocab - 1})",
                               param=field)
        # Counts of tokens: past the vocabulary, the sampler's top-k has nothing to keep.
        for field, count in {"top_k": params.top_k, "logprobs": params.logprobs}.items():
            if count is not None and count > vocab:
                raise ApiError(422, f"{field} is {count}; it must be at most the vocabulary size, {vocab}",
                               param=field)

    async def tier(self, tenant: str, requested: str) -> str:
        """The service tier a request of `tenant` asking for `requested` runs in (403 where it may
        not use it; every tier where limits are off)."""
        if self.limits is not None and tenant:
            return await self.limits.service_tier(tenant, requested)
        return service_tier.resolve(requested, service_tier.TIERS, service_tier.DEFAULT_AUTO)

    async def submit(self, payloads: list[RequestPayload], tenant: str = "") -> None:
        """Queue the requests for `tenant`, all or none (past the backlog limit, 503)."""
        if not payloads:  # e.g. /generate with no prompts: nothing to queue, nothing to count
            return
        if any(p.pool is None for p in payloads):
            self.require_generative()
        if self.adapter is not None:
            await self._check_adapter(tenant)
            if bad := sorted({p.backend for p in payloads if p.backend and p.backend not in self.adapter_backends}):
                raise ApiError(400, f"adapter {self.adapter!r} is served by workers of {sorted(self.adapter_backends)}, "
                                    f"not of {bad}", param="backend")
        if self.affinity is not None:
            for payload in payloads:  # a prefix is hashed in its tenant's space (shared/prefix_scope.py)
                payload.tenant = tenant
            await self.affinity.route(payloads)
        weight, costs = 1.0, [p.cost_tokens for p in payloads]
        if self.limits is not None and tenant:
            weight = await self.limits.charge(tenant, [p.id for p in payloads], costs)
        trace_context = tracing.inject()  # the request span's (api/core/tracing.py): the worker's spans join it
        for payload in payloads:
            payload.tenant, payload.weight, payload.trace = tenant, weight, trace_context
        if trace_context is not None:
            first = payloads[0]
            span = trace.get_current_span()
            span.set_attributes(tracing.request_attributes(first.model, first.num_prompt_tokens,
                                                           first.params.max_tokens))
            span.set_attribute("streamq.request_ids", [p.id for p in payloads])
        try:
            if self.backpressure is not None:
                await self.backpressure.enqueue(self.store, payloads)
            else:
                await self.store.enqueue(payloads)
        except ApiError:
            if self.limits is not None and tenant:  # refused: what the limits counted was never queued
                await self.limits.release(tenant, [p.id for p in payloads], costs)
            raise
        for payload in payloads:
            fields = {"request_id": payload.id, "tenant": tenant, "prompt_tokens": payload.num_prompt_tokens,
                      "max_tokens": payload.params.max_tokens, "priority": payload.priority,
                      "affinity": payload.affinity}
            if self.log_prompts:
                fields["prompt"] = self.tokenizer.decode(payload.prompt_token_ids)
            log.info("request %s accepted (%d prompt tokens)", payload.id, payload.num_prompt_tokens, extra=fields)

    async def _check_adapter(self, tenant: str) -> None:
        """404 where the adapter is kept to other tenants (/v1/load_lora_adapter's `tenants`), as for
        a model this tenant cannot see."""
        entry = await LoraRegistry(self.store.redis, self.store.prefix).entry(self.base_model, self.adapter)
        if entry is not None and not entry.allows(tenant):
            raise ApiError(404, f"model {self.adapter!r} is not served here", param="model", code="model_not_found")

    async def cancel(self, payloads: list[RequestPayload]) -> None:
        for payload in payloads:
            await self.store.cancel(payload.id, payload.num_prompt_tokens)

    async def collect(self, payloads: list[RequestPayload]) -> list[Choice]:
        """Every payload's reply, whole."""
        choices = [Choice() for _ in payloads]
        async for i, event in self.follow([p.id for p in payloads]):
            if isinstance(event, TokenEvent):
                choices[i].text.append(event.text)
                choices[i].tokens.append(event)
            elif isinstance(event, FinalEvent):
                choices[i].final = event
        return choices

    async def follow(self, ids: list[str]) -> AsyncIterator[tuple[int, Event | None]]:
        """Events of several requests as they come: (index in `ids`, event); None is a keepalive.

        Ends after every request's final event.
        """
        if len(ids) == 1:
            async for event in self.relay.events(ids[0]):
                yield 0, event
            return
        queue: asyncio.Queue[tuple[int, Event | None]] = asyncio.Queue()

        async def pump(i: int, request_id: str) -> None:
            async for event in self.relay.events(request_id):
                await queue.put((i, event))  # None (keepalive) included

        tasks = [asyncio.create_task(pump(i, rid)) for i, rid in enumerate(ids)]
        remaining = len(ids)
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item[1], FinalEvent):
                    remaining -= 1
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _thought_free(samples: list[SamplingParams], reasoning: ThinkFormat) -> list[SamplingParams]:
    """A thinking model's samples with their constraint (structured outputs, or the tool format's)
    applied after the thought, which stays free: from the prompt's opened thought to its end tag,
    or after an optional thought the model opens itself."""
    if not isinstance(reasoning, ThinkFormat):  # Harmony: its tool grammar has the thought; others hold from the start
        return samples
    prefix = ThoughtPrefix(open="" if reasoning.opened else OPEN, close=CLOSE)
    moved: dict[int, StructuredOutputs] = {}  # the samples share one constraint: moved once
    out = []
    for params in samples:
        constraint = params.structured_outputs
        if constraint is None:
            out.append(params)
            continue
        if id(constraint) not in moved:
            moved[id(constraint)] = constraint.model_copy(update={"after_thought": prefix})
        out.append(params.model_copy(update={"structured_outputs": moved[id(constraint)]}))
    return out
