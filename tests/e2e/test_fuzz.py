"""Fuzzing the live api, on a bounded budget: no input gets a 5xx, every refusal comes in its
path's error body, no process dies, and a valid request running throughout ends with exactly
the text it has when run alone.

schemathesis covers the OpenAPI schema (its CLI, since its pytest plugin does not load under
pytest 9); hypothesis sends what a schema cannot describe: NaN, Infinity, 1e999, lone
surrogates, huge integers and deep nesting, in any field of every generation path."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.helpers import submit, wait_done

SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"
OPENAI = ("/v1/completions", "/v1/chat/completions", "/v1/batches", "/v1/responses")
SAMPLING = {"max_tokens": 2, "temperature": 0.5, "top_p": 0.9, "seed": 1}
COMPLETION = {"prompt": "hi", **SAMPLING, "top_k": 5, "n": 1, "logit_bias": {"3": 1.0}, "stop": ["zz"], "user": "u"}
QUERY = {"query": "hi", **SAMPLING, "n": 1, "request_id": "r1"}
# A valid body per path, and the fields to spoil in it (a path of keys and indexes).
BODIES: dict[str, tuple[dict, list[tuple]]] = {
    "/v1/requests": ({"prompt": "hi", **SAMPLING, "top_k": 5, "priority": 0, "logit_bias": {"3": 1.0},
                      "stop": ["zz"], "model": "m"},
                     [("prompt",), ("temperature",), ("seed",), ("max_tokens",), ("priority",), ("top_k",),
                      ("logit_bias", "3"), ("stop", 0), ("model",)]),
    "/v1/completions": (COMPLETION, [("prompt",), ("temperature",), ("seed",), ("max_tokens",), ("top_k",),
                                     ("n",), ("logit_bias", "3"), ("stop", 0), ("user",)]),
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": "hi"}], **SAMPLING, "top_k": 5},
                             [("messages", 0, "content"), ("messages", 0, "role"), ("temperature",), ("seed",),
                              ("max_tokens",), ("top_k",)]),
    "/v1/responses": ({"input": [{"role": "user", "content": "hi"}], "instructions": "be brief",
                       "max_output_tokens": 2, "temperature": 0.5, "top_p": 0.9, "metadata": {"k": "v"}},
                      [("input", 0, "content"), ("input", 0, "role"), ("instructions",), ("max_output_tokens",),
                       ("temperature",), ("top_p",), ("metadata", "k")]),
    "/basic_generate": ({"prompt": "hi"}, [("prompt",)]),
    "/generate": ({"prompts": ["hi"]}, [("prompts", 0), ("prompts",)]),
    "/generate_stream": ({"prompt": "hi"}, [("prompt",)]),
    "/generate_vllm": ({"prompts": ["hi"]}, [("prompts", 0)]),
    "/generate/": (QUERY, [("query",), ("temperature",), ("top_p",), ("seed",), ("max_tokens",), ("n",),
                           ("request_id",)]),
    "/generate_stream/": (QUERY, [("query",), ("temperature",), ("seed",), ("max_tokens",), ("request_id",)]),
    "/v1/batches": ({"endpoint": "/v1/completions",
                     "requests": [{"custom_id": "a", "body": {"prompt": "hi", **SAMPLING}}]},
                    [("requests", 0, "custom_id"), ("requests", 0, "body", "prompt"),
                     ("requests", 0, "body", "temperature"), ("requests", 0, "body", "seed")]),
}
# Raw JSON that no body may hold anywhere: each is refused, in its path's error body.
REFUSED = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity", "1e999": "1e999", "-1e999": "-1e999",
           "surrogate": '"x\\ud800y"', "surrogate key": '{"\\udc00": 1}', "deep": "[" * 10_000 + "]" * 10_000,
           "digits": "9" * 5000}
# Valid JSON that fields may still refuse (a 4xx) but never fail on (a 5xx).
HUGE = ["9223372036854775807", "9223372036854775808", "18446744073709551616", "-" + "9" * 40, "1" + "0" * 300]
HOLE = "\x00spoilt\x00"


def spoil(body: dict, field: tuple, raw: str) -> bytes:
    """The body as JSON with `raw` (JSON text that json.dumps cannot write) at `field`."""
    body = json.loads(json.dumps(body))
    *parents, last = field
    holder = body
    for key in parents:
        holder = holder[key]
    holder[last] = HOLE
    return json.dumps(body).replace(json.dumps(HOLE), raw).encode()


def check_refusal(path: str, reply: httpx.Response) -> dict:
    """A 4xx in the path's error body: OpenAI's on the OpenAI paths, {"detail"} elsewhere."""
    assert 400 <= reply.status_code < 500, (path, reply.status_code, reply.text[:500])
    body = reply.json()
    if path.startswith(OPENAI):
        assert set(body) == {"error"}, (path, reply.text[:500])
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    else:
        assert set(body) == {"detail"} and body["detail"], (path, reply.text[:500])
    return body


@pytest.fixture(scope="module")
def api(stack):
    return stack.urls[0]


@pytest.fixture
def watched(stack, api):
    """A greedy request that runs while the test fuzzes; it must end with the text it has alone."""
    body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=120) as client:
        alone = wait_done(client, api, submit(client, api, **body)["id"])
        assert alone["status"] == "done" and alone["completion_tokens"] == 200
        running = submit(client, api, **body)["id"]
        yield
        during = wait_done(client, api, running, timeout_s=600)
    assert during["status"] == "done" and during["text"] == alone["text"]
    for name, proc in stack.processes:
        assert proc.poll() is None, f"{name} died"


def test_schemathesis_finds_no_server_error(watched, api, tmp_path):
    out = subprocess.run([str(SCHEMATHESIS), "run", f"{api}/openapi.json", "--checks", "not_a_server_error",
                          "--max-examples", "5", "--seed", "20261130", "--request-timeout", "60",
                          "--no-color"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-4000:]
    assert "passed" in out.stdout and "Server error" not in out.stdout
    reply = httpx.post(f"{api}/v1/requests", json={"prompt": "ok", "max_tokens": 2}, timeout=30)
    assert reply.status_code == 202


@pytest.mark.parametrize("path", list(BODIES))
def test_what_no_json_body_may_hold_is_refused_naming_the_field(api, path):
    body, fields = BODIES[path]
    with httpx.Client(timeout=60) as client:
        for name, raw in REFUSED.items():
            reply = client.post(f"{api}{path}", content=spoil(body, fields[0], raw),
                                headers={"Content-Type": "application/json"})
            answer = check_refusal(path, reply)
            assert reply.status_code == (400 if path.startswith(OPENAI) else 422), (name, reply.text)
            if name not in ("deep", "digits"):  # those are refused as a whole body
                assert str(fields[0][-1]) in json.dumps(answer), (name, answer)


def test_hostile_values_anywhere_never_get_a_server_error(watched, api):
    cases = [(path, field) for path, (_, fields) in BODIES.items() for field in [*fields, ("unknown_field",)]]

    @settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(case=st.sampled_from(cases), raw=st.sampled_from([*REFUSED.values(), *HUGE]))
    def one(client: httpx.Client, case: tuple, raw: str) -> None:
        path, field = case
        reply = client.post(f"{api}{path}", content=spoil(BODIES[path][0], field, raw),
                            headers={"Content-Type": "application/json"})
        assert reply.status_code < 500, (path, field, raw[:40], reply.text[:500])
        if raw in REFUSED.values() or reply.status_code >= 400:
            check_refusal(path, reply)

    with httpx.Client(timeout=120) as client:
        one(client)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/requests", "/generate"])
def test_an_oversized_body_gets_its_413_not_a_reset(api, path):
    # httpx sends no `Expect: 100-continue`: the whole body is on its way when the answer comes.
    with httpx.Client(timeout=120) as client:
        reply = client.post(f"{api}{path}", content=b"x" * (16 * 2**20), headers={"Content-Type": "application/json"})
        assert reply.status_code == 413 and "limit is 1000000" in json.dumps(check_refusal(path, reply))
        chunked = client.post(f"{api}{path}", content=iter([b"x" * 2**20] * 4))  # no Content-Length
        assert chunked.status_code == 411 and "Content-Length" in json.dumps(check_refusal(path, chunked))


def test_a_chat_content_part_whose_text_is_not_a_string_is_a_400(api):
    reply = httpx.post(f"{api}/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]})
    assert reply.status_code == 400 and "text" in check_refusal("/v1/chat/completions", reply)["error"]["message"]


def test_the_largest_seed_with_several_samples_counts_on_from_zero(api):
    body = {"query": "hi", "seed": 2**63 - 1, "n": 2, "max_tokens": 2, "temperature": 1.0}
    assert httpx.post(f"{api}/generate_stream/", json=body, timeout=60).status_code == 200
