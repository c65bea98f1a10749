"""Admission before CPU work, with the grammar pool's real processes (api/core/grammar_pool.py):
a tenant past its limits gets its 429s without one compile (nor a prompt tokenized), even with
large schemas and many samples; a compile held in the pool leaves the event loop free (/healthz
answers meanwhile); and a compile past the time cap is a 400 naming the cap, after which the pool
serves the next. Compiles are held by named pipes (tests/grammar_hold.py), never by time. Real
Redis, the real app, keys on."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.core.grammar_pool import GrammarPool
from api.core.limits import Limits
from shared.api_keys import KeyStore
from shared.settings import ApiSettings
from shared.tokenizer import Tokenizer
from tests.grammar_hold import Hold

_rng = random.Random(0)
# The report's kind of schema: hundreds of properties, each with a pattern (about 45,000 characters).
LARGE = {"type": "object", "properties": {
    "".join(_rng.choice("abcdefghij") for _ in range(12)): {"type": "string", "pattern": "(a|b)*a(a|b){8}c"}
    for _ in range(700)}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "big", "schema": LARGE}}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def hold(tmp_path):
    hold = Hold(tmp_path)
    yield hold
    hold.close()


async def _keys(redis, prefix) -> dict[str, dict[str, str]]:
    """The flooder (one request a minute) and another tenant (no limits): each one's headers."""
    store = KeyStore(redis, prefix)
    await Limits(redis, prefix, 3600).set("flooder", rpm=1)
    return {tenant: {"Authorization": f"Bearer {await store.create(tenant)}"} for tenant in ("flooder", "other")}


async def test_over_limit_requests_get_their_429_without_a_compile_and_a_held_compile_leaves_the_loop_free(
        redis, redis_url, prefix, tiny_llama, counted_tokenizer, hold):
    tokenizer, calls = counted_tokenizer
    headers = await _keys(redis, prefix)
    settings = ApiSettings(_env_file=None, redis_url=redis_url, prefix=prefix, model=str(tiny_llama),
                           served_model_name="m", auth="on")
    pool = GrammarPool(1, timeout_s=600, check=hold.check)  # the cap only bounds a failing test
    with TestClient(create_app(settings, tokenizer, grammars=pool), base_url="http://127.0.0.1") as client, \
            ThreadPoolExecutor(1) as background:
        used = client.post("/v1/requests", json={"prompt": "a b", "max_tokens": 2}, headers=headers["flooder"])
        assert used.status_code == 202, used.text  # the flooder's one request of the minute
        # The other tenant's constrained request: its compile starts in the pool and is held there.
        held = background.submit(client.post, "/v1/requests", headers=headers["other"], json={
            "prompt": "a b", "max_tokens": 2, "structured_outputs": {"json": LARGE}})
        hold.wait_started()
        assert client.get("/healthz").json() == {"status": "ok"}  # the loop answers while the compile runs
        calls.clear()
        for i in range(50):  # as in the report: large schemas, n samples with top_logprobs
            path, body = [
                ("/v1/chat/completions", {"messages": MESSAGES, "response_format": FORMAT, "n": 8, "logprobs": True,
                                          "top_logprobs": 20}),
                ("/v1/completions", {"prompt": "x " * 200, "n": 8, "logprobs": 5, "structured_outputs": {"json": LARGE}}),
                ("/v1/requests", {"prompt": "x", "structured_outputs": {"json": LARGE}}),
                ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "big",
                                                                      "schema": LARGE}}}),
            ][i % 4]
            over = client.post(path, json=body, headers=headers["flooder"])
            assert over.status_code == 429 and "requests per minute" in over.text, (path, over.text)
        assert calls == [] and hold.compiles() == 1 and pool.compiles == 1  # only the other tenant's
        assert client.get("/healthz").status_code == 200
        hold.release()
        assert held.result().status_code == 202, held.result().text


async def test_a_compile_past_the_cap_is_400_naming_it_and_the_pool_serves_the_next(
        redis, redis_url, prefix, tiny_llama, hold):
    headers = await _keys(redis, prefix)
    settings = ApiSettings(_env_file=None, redis_url=redis_url, prefix=prefix, model=str(tiny_llama),
                           served_model_name="m", auth="on")
    pool = GrammarPool(1, timeout_s=1, check=hold.check)
    with TestClient(create_app(settings, Tokenizer(tiny_llama), grammars=pool), base_url="http://127.0.0.1") as client:
        client.portal.call(pool.ready)  # the process is up: the cap times the compile alone
        [first] = pool.pids()
        # Held and never released: it cannot finish within the cap.
        refused = client.post("/v1/chat/completions", headers=headers["other"],
                              json={"messages": MESSAGES, "max_tokens": 2, "response_format": FORMAT})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "response_format" and error["type"] == "invalid_request_error"
        assert "longer than the 1 s" in error["message"] and "STREAMQ_COMPILE_TIMEOUT_S" in error["message"]
        client.portal.call(pool.ready)
        assert pool.pids() != [first]  # killed and replaced
        hold.release()  # the next one compiles, for real, in the new process
        bad = client.post("/v1/chat/completions", headers=headers["other"], json={
            "messages": MESSAGES, "max_tokens": 2, "structured_outputs": {"regex": "[0-9"}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "structured_outputs", bad.text
        assert "regex" in bad.json()["error"]["message"] and hold.compiles() == 2
