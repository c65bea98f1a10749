"""The vLLM backend, for real: vLLM's CPU build in its own virtualenv (`make vllm-env`) runs a
worker next to a built-in one, on the default model, behind the same queue.

Greedy output is compared with the built-in backend's on the same prompt (fp32, both on the CPU).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import pytest

from tests.e2e.helpers import events_of, fp32_activations_env, submit, token_ids, wait_done
from tests.stack import ROOT, Stack, stream_events

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]
VLLM_ENV = {"STREAMQ_BACKEND": "vllm", "STREAMQ_VLLM_ENFORCE_EAGER": "true", "STREAMQ_VLLM_MAX_MODEL_LEN": "1024",
            "STREAMQ_KV_CACHE_GB": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "STREAMQ_METRICS_PORT": "0"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(redis_url, tmp_path_factory):
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: `make vllm-env` creates it (`make test` runs it)")
    env = {"STREAMQ_MODEL_CACHE_DIR": "", "STREAMQ_HEARTBEAT_TTL_S": "4", "STREAMQ_HEARTBEAT_INTERVAL_S": "1",
           "STREAMQ_RECLAIM_INTERVAL_S": "1"}
    # the built-in engine is vLLM's reference here: the same float computation (fp32 activations)
    with Stack(redis_url, None, tmp_path_factory.mktemp("vllm"), workers=2, scheduler=True, env=env,
               worker_envs=[VLLM_ENV, fp32_activations_env()], worker_python=[str(VLLM_PYTHON), None]) as running:
        wait_for_backend(running, "vllm")
        yield running


def wait_for_backend(stack: Stack, backend: str, timeout_s: float = 300) -> dict:
    """The live worker of `backend` (vLLM starts in tens of seconds, after the built-in one)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name, proc in stack.processes:
            assert proc.poll() is None, f"{name} exited:\n{stack.logs()}"
        workers = httpx.get(f"{stack.urls[0]}/readyz", timeout=5).json().get("workers", [])
        if found := [w for w in workers if w["backend"] == backend]:
            return found[0]
        time.sleep(0.5)  # polling for start-up only
    raise AssertionError(f"no live {backend} worker after {timeout_s} s:\n{stack.logs()}")


def chat(backend: str, max_tokens: int, **extra) -> dict:
    return {"messages": CHAT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "backend": backend,
            **extra}


def test_vllm_streams_what_the_built_in_engine_generates(stack):
    with httpx.Client(timeout=300) as client:
        vllm = stream_events(client, "POST", f"{stack.urls[0]}/v1/requests", json=chat("vllm", 24, stream=True))
        hf = stream_events(client, "POST", f"{stack.urls[0]}/v1/requests", json=chat("hf", 24, stream=True))
        assert [int(e["id"]) for e in vllm if e["event"] == "token"] == list(range(24))
        assert token_ids(vllm) == token_ids(hf)
        assert vllm[-1]["data"]["finish_reason"] == "length"
        # Poll gives the same, and the record names the vLLM worker.
        rid = submit(client, stack.urls[0], **chat("vllm", 8))["id"]
        state = wait_done(client, stack.urls[0], rid)
        assert state["status"] == "done" and state["completion_tokens"] == 8
        assert state["worker"] == stack.worker_name(0)


def test_cancel_aborts_in_vllm_and_frees_the_slot(stack):
    with httpx.Client(timeout=300) as client:
        rid = submit(client, stack.urls[0], **chat("vllm", 400))["id"]
        first = stream_events(client, "GET", f"{stack.urls[0]}/v1/requests/{rid}/events", stop_after=1)
        assert first
        assert client.delete(f"{stack.urls[0]}/v1/requests/{rid}").status_code in (200, 202)
        final = wait_done(client, stack.urls[0], rid)
        assert final["status"] == "cancelled" and final["completion_tokens"] < 400
        after = wait_done(client, stack.urls[0], submit(client, stack.urls[0], **chat("vllm", 4))["id"])
        assert after["status"] == "done"


def test_generate_vllm_goes_to_the_vllm_worker(stack):
    with httpx.Client(timeout=300) as client:
        worker = wait_for_backend(stack, "vllm")
        metrics = f"http://127.0.0.1:{worker['metrics_port']}/metrics"
        before = _finished(client.get(metrics).text)
        reply = client.post(f"{stack.urls[0]}/generate_vllm", json={"prompts": ["Hello", "The sea is"]})
        assert reply.status_code == 200 and len(reply.json()["generated_texts"]) == 2
        assert _finished(client.get(metrics).text) - before == 2


def test_a_request_asking_for_a_backend_nobody_runs_gets_404(stack):
    reply = httpx.post(f"{stack.urls[0]}/v1/requests", json=chat("null", 4), timeout=30)
    assert reply.status_code == 404 and "live backends: ['hf', 'vllm']" in reply.text


def test_a_killed_vllm_worker_is_continued_by_the_next_one(stack):
    with httpx.Client(timeout=300) as client:
        reference = token_ids(stream_events(client, "POST", f"{stack.urls[0]}/v1/requests",
                                            json=chat("hf", 40, stream=True)))
        rid = submit(client, stack.urls[0], **chat("vllm", 40))["id"]
        first = stream_events(client, "GET", f"{stack.urls[0]}/v1/requests/{rid}/events", stop_after=5)
        stack.kill_worker(stack.worker_name(0))
        delivered = len(token_ids(first))
        stack.start_worker(0, "worker0-again")
        events = events_of(client, stack.urls[0], rid)
        assert token_ids(events) == reference  # the new vLLM worker prefilled prompt + delivered tokens
        assert events[-1]["data"]["status"] == "done" and delivered >= 5


def test_choosing_vllm_where_it_is_not_installed_fails_at_start_with_how_to_fix_it(redis_url, tmp_path):
    env = {"REDIS_URL": redis_url, "STREAMQ_BACKEND": "vllm", "STREAMQ_PREFIX": "novllm",
           "STREAMQ_METRICS_PORT": "-1"}
    proc = subprocess.run([sys.executable, "-m", "streamq.cli", "worker"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, **env})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "make vllm-env" in proc.stderr


def _finished(text: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("streamq:request_success_total{"))


def test_the_same_constraint_gives_valid_output_on_either_backend(stack):
    """structured_outputs on the default model, through vLLM's structured outputs and through the
    built-in engine's masks: every output obeys its constraint."""
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "country", "population"],
              "properties": {"city": {"type": "string", "maxLength": 40},
                             "country": {"type": "string", "maxLength": 40},
                             "population": {"type": "integer", "minimum": 0, "maximum": 99_999_999}}}
    constraints = {"json": schema, "regex": r"(yes|no), [0-9]{1,3}", "choice": ["Paris", "Lyon", "Marseille"]}
    question = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    with httpx.Client(timeout=300) as client:
        for backend in ("vllm", "hf"):
            for form, value in constraints.items():
                rid = submit(client, stack.urls[0], messages=question, max_tokens=120, temperature=0, backend=backend,
                             structured_outputs={form: value})["id"]
                state = wait_done(client, stack.urls[0], rid)
                assert state["status"] == "done" and state["finish_reason"] == "stop", (backend, form, state)
                text = state["text"]
                if form == "json":
                    value = json.loads(text)
                    assert set(value) == {"city", "country", "population"} and isinstance(value["population"], int)
                elif form == "regex":
                    assert re.fullmatch(constraints["regex"], text), (backend, text)
                else:
                    assert text in constraints["choice"], (backend, text)


def test_tool_calls_validate_on_either_backend(stack):
    """Tools through the official client on the default model (the generic format), and the
    Hermes format's grammar (a Lark grammar with each call's JSON under a schema) as
    structured_outputs: vLLM runs both constraints as the built-in engine does."""
    import openai

    from api.core.parsers import hermes
    from api.core.tools import Tool

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 20}}}}}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    grammar = hermes.constraint([Tool.model_validate(t) for t in tools], "required", False).grammar
    client = openai.OpenAI(base_url=f"{stack.urls[0]}/v1", api_key="unused", max_retries=0, timeout=300)
    for backend in ("vllm", "hf"):
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            reply = client.chat.completions.create(model=stack.model_name, messages=ask, tools=tools,
                                                   tool_choice=choice, parallel_tool_calls=False, max_tokens=80,
                                                   temperature=0, extra_body={"backend": backend})
            assert reply.choices[0].message.tool_calls, (backend, reply.choices[0])
            call = reply.choices[0].message.tool_calls[0]
            assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather", backend
            assert set(json.loads(call.function.arguments)) == {"city"}, (backend, call.function.arguments)
        text = client.completions.create(model=stack.model_name, prompt="Call a tool:", max_tokens=60, temperature=0,
                                         extra_body={"backend": backend, "structured_outputs": {"grammar": grammar}},
                                         ).choices[0].text
        content, calls = hermes.parse(text)
        assert content is None and len(calls) == 1 and set(json.loads(calls[0]["function"]["arguments"])) == {"city"}, \
            (backend, text)


def test_the_responses_api_runs_on_vllm_as_on_the_built_in_engine(stack):
    """The Responses layer is the api's: a streamed response on the vLLM worker gives the text of
    the same response on the built-in one, in the same events."""
    import openai

    client = openai.OpenAI(base_url=f"{stack.urls[0]}/v1", api_key="unused", max_retries=0, timeout=300)
    streams = {backend: list(client.responses.create(
        model=stack.model_name, input=CHAT[0]["content"], temperature=0, max_output_tokens=16, stream=True,
        extra_body={"backend": backend})) for backend in ("vllm", "hf")}
    for events in streams.values():
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 16
    assert streams["vllm"][-1].response.output_text == streams["hf"][-1].response.output_text
    assert [e.type for e in streams["vllm"]] == [e.type for e in streams["hf"]]


def test_deterministic_mode_on_vllms_cpu_build_is_refused_at_start(redis_url):
    """vLLM's CPU attention has no batch-invariant mode: the worker says so and exits, before
    it loads anything."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: `make vllm-env` creates it (`make test` runs it)")
    env = {"REDIS_URL": redis_url, "STREAMQ_BACKEND": "vllm", "STREAMQ_PREFIX": "detvllm",
           "STREAMQ_DETERMINISTIC": "true", "STREAMQ_METRICS_PORT": "-1", "STREAMQ_MODEL_CACHE_DIR": ""}
    proc = subprocess.run([str(VLLM_PYTHON), "-m", "streamq.cli", "worker"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={k: v for k, v in {**__import__("os").environ, **env}.items() if v})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "no batch-invariant mode" in proc.stderr and "backend=hf" in proc.stderr


def test_a_lora_adapter_runs_on_vllm_as_on_the_built_in_engine(redis_url, tmp_path):
    """The same peft adapter served by both backends (vLLM's own LoRA; the built-in engine's): a
    request naming it gives the same greedy tokens on either, and not the base model's."""
    from shared.model_paths import prepare_model, weights_dir
    from shared.settings import WorkerSettings
    from streamq.testing.lora_adapters import make_adapter

    settings = WorkerSettings(_env_file=None)
    prepare_model(settings)
    adapter = make_adapter(weights_dir(settings), tmp_path / "sea", r=8, seed=1, magnitude=0.3)
    lora = {"STREAMQ_LORA_MODULES": f"sea={adapter}"}
    env = {"STREAMQ_MODEL_CACHE_DIR": "", "STREAMQ_HEARTBEAT_INTERVAL_S": "1"}
    with Stack(redis_url, None, tmp_path / "stack", workers=2, env=env,
               worker_envs=[{**VLLM_ENV, **lora}, {**fp32_activations_env(), **lora}],
               worker_python=[str(VLLM_PYTHON), None]) as running:
        wait_for_backend(running, "vllm")
        models = httpx.get(f"{running.urls[0]}/v1/models", timeout=30).json()["data"]
        assert any(m["id"] == "sea" and m["parent"] == running.model_name for m in models)
        with httpx.Client(timeout=300) as client:
            def tokens(backend: str, model: str) -> list[int]:
                body = {**chat(backend, 16, stream=True), "model": model}
                return token_ids(stream_events(client, "POST", f"{running.urls[0]}/v1/requests", json=body))
            on_vllm, built_in = tokens("vllm", "sea"), tokens("hf", "sea")
            assert len(on_vllm) == 16 and on_vllm == built_in
            assert on_vllm != tokens("hf", running.model_name)
