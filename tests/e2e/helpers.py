"""Shared steps of the end-to-end tests."""
from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai

from shared import redis_keys
from shared.messages import RequestStatus
from tests.stack import Stack, stream_events


def submit(client: httpx.Client, url: str, **body) -> dict:
    reply = client.post(f"{url}/v1/requests", json=body)
    assert reply.status_code == 202, reply.text
    return reply.json()


def wait_done(client: httpx.Client, url: str, request_id: str, timeout_s: float = 120) -> dict:
    """Long-poll until the request ends (each call answers at the next change, or after 10 s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = client.get(f"{url}/v1/requests/{request_id}", params={"wait": 10}).json()
        if state["status"] in ("done", "failed", "cancelled", "expired"):
            return state
    raise AssertionError(f"request {request_id} did not finish within {timeout_s} s: {state}")


def batch_results(client: httpx.Client, url: str, batch: dict, timeout_s: float = 120) -> tuple[dict, list[dict]]:
    """Poll a batch until it completes (polling is this API's contract); the batch and its result lines."""
    import json

    deadline = time.monotonic() + timeout_s
    while batch["status"] != "completed":
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        batch = client.get(f"{url}/v1/batches/{batch['id']}").json()
    return batch, [json.loads(x) for x in client.get(f"{url}{batch['results_url']}").text.splitlines()]


def token_ids(events: list[dict]) -> list[int]:
    return [e["data"]["token_id"] for e in events if e.get("event") == "token"]


def events_of(client: httpx.Client, url: str, request_id: str, last_event_id: int | None = None) -> list[dict]:
    headers = {} if last_event_id is None else {"Last-Event-ID": str(last_event_id)}
    return stream_events(client, "GET", f"{url}/v1/requests/{request_id}/events", headers=headers)


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    """transformers' own greedy generate, unbatched: the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if ignore_eos:  # go on through EOS, as a request with ignore_eos does
        model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def fp32_activations_env() -> dict[str, str]:
    """The worker setting that holds its quantized projections to fp32 activations (the widest
    such kernels this CPU has). A test that compares a quantized model with a float reference (vLLM
    or transformers on the dequantized weights) needs it: on AVX-512 VNNI, `auto` rounds
    activations to int8 (docs/models.md), which is not the float computation bit for bit."""
    from worker.model import kernels

    return {"STREAMQ_CPU_ISA": kernels.widest_fp32(kernels.load())}


def response_request_id(stack: Stack, response_id: str) -> str:
    """The id of the request that runs a stored response (a tenant-less stack's)."""
    with stack.redis() as client:
        return client.hget(redis_keys.response_record(stack.prefix, "", response_id), "request_id")


def held_mid_response(client: openai.OpenAI, stack: Stack, prompt: str, max_output_tokens: int,
                      attempts: int = 5):
    """A background response streamed up to its first text delta, then every worker paused while
    its request still runs: (the created response, its open stream, the events so far). A worker
    runs ahead of its client, and on a loaded machine may end the response before the client saw
    a delta (the stream replays from the start); then the workers go on and a new response is
    tried, so the pause is mid-response."""
    for _ in range(attempts):
        created = client.responses.create(input=prompt, temperature=0, max_output_tokens=max_output_tokens,
                                          background=True)
        stream = client.responses.retrieve(created.id, stream=True)
        seen = []
        for event in stream:
            seen.append(event)
            if event.type == "response.output_text.delta":
                stack.pause_workers()
                break
        else:
            raise AssertionError(f"the stream ended before any text: {seen}")
        record = stack.record(response_request_id(stack, created.id))
        if record is not None and record.status == RequestStatus.RUNNING:
            return created, stream, seen
        stack.resume_workers()
        list(stream)
    raise AssertionError(f"the response ended before its workers were paused, {attempts} times")
