"""STREAMQ_LOG_FORMAT=json: one JSON object per line, with the request id, worker and timings,
and the prompt only when STREAMQ_LOG_PROMPTS asks for it."""
from __future__ import annotations

import json

import httpx

from tests.e2e.helpers import submit, wait_done
from tests.stack import Stack

SECRET = "my secret recipe for soup"


def json_lines(path) -> list[dict]:
    """Every line of a process's output (stdout and stderr) as JSON: none may be anything else,
    a library's progress bar included (its carriage returns split lines here, as in a pipeline)."""
    lines = []
    for text in path.read_text(errors="replace").splitlines():
        if not text.strip():
            continue
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError:
            raise AssertionError(f"{path.name} has a line that is not JSON: {text!r}") from None
    return lines


def test_json_logs_follow_a_request_and_leave_out_the_prompt(redis_url, tiny_llama, tmp_path):
    with Stack(redis_url, tiny_llama, tmp_path, scheduler=True, env={"STREAMQ_LOG_FORMAT": "json"}) as stack, \
            httpx.Client(timeout=60) as client:
        rid = submit(client, stack.urls[0], prompt=SECRET, max_tokens=4, ignore_eos=True)["id"]
        assert wait_done(client, stack.urls[0], rid)["status"] == "done"
    api, worker = json_lines(tmp_path / "api0.log"), json_lines(tmp_path / "worker0.log")
    assert api and worker and json_lines(tmp_path / "scheduler.log")
    [accepted] = [line for line in api if line.get("request_id") == rid]
    assert accepted["prompt_tokens"] > 0 and accepted["max_tokens"] == 4 and "prompt" not in accepted
    started, finished = [line for line in worker if line.get("request_id") == rid]
    assert started["msg"].endswith("started") and started["queue_s"] >= 0
    assert finished["finish_reason"] == "length" and finished["completion_tokens"] == 4
    assert finished["worker"] == started["worker"] and 0 <= finished["ttft_s"] <= finished["e2e_s"]
    assert all({"ts", "level", "logger", "msg"} <= set(line) for line in api + worker)
    assert SECRET not in "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.log"))


def test_prompts_are_logged_when_asked(redis_url, tiny_llama, tmp_path):
    env = {"STREAMQ_LOG_FORMAT": "json", "STREAMQ_LOG_PROMPTS": "true"}
    with Stack(redis_url, tiny_llama, tmp_path, env=env) as stack, httpx.Client(timeout=60) as client:
        rid = submit(client, stack.urls[0], prompt=SECRET, max_tokens=1)["id"]
        wait_done(client, stack.urls[0], rid)
    [accepted] = [line for line in json_lines(tmp_path / "api0.log") if line.get("request_id") == rid]
    assert SECRET in accepted["prompt"]
