"""A request turned into the RequestPayloads the workers run: checked against the model, not
queued yet (Generation.submit queues them). One payload per sample (`n`, or `best_of`)."""
from __future__ import annotations

from api.core.chat import ChatRequest, SamplingFields
from api.core.errors import ApiError
from api.core.generation import Generation
from shared.messages import RequestPayload


async def build_payloads(generation: Generation, body: SamplingFields, prompt_ids: list[int], samples: int,
                         max_tokens: int | None, logprobs: int | None) -> list[RequestPayload]:
    """`samples` payloads of one prompt, each with its own seed."""
    try:
        payloads = [generation.build(prompt_ids, body.sampling(max_tokens, logprobs, i), body.priority)
                    for i in range(samples)]
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc
    if body.backend is not None:
        await generation.check_backend(body.backend)
        for payload in payloads:
            payload.backend = body.backend
    return payloads


async def chat_payloads(body: ChatRequest, generation: Generation) -> tuple[list[RequestPayload], int | None]:
    """The payloads one chat runs, and the logprobs it asked for; its replies are read in the
    model's tool format (Generation.tool_format)."""
    generation.check_model(body.model)
    if body.calls_tools:
        try:
            body.use_tool_format(generation.tool_format)
        except ValueError as exc:  # the tools' grammar in this format does not compile
            raise ApiError(400, str(exc), param="tools") from exc
    try:
        messages = body.template_messages()
        logprobs = body.wanted_logprobs()
    except ValueError as exc:
        raise ApiError(400, str(exc), param="messages") from exc
    prompt_ids = await generation.encode(messages=messages, tools=body.template_tools())
    return await build_payloads(generation, body, prompt_ids, body.n, body.max_completion_tokens or body.max_tokens,
                                logprobs), logprobs
