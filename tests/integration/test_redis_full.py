"""A Redis at its maxmemory (noeviction, as `streamq serve` and deploy/ run it) refuses new writes:
the api answers a submit 503 in the route's error body, says why, and leaves no record behind."""
import pytest
from fastapi.testclient import TestClient
from redis import Redis
from redis.exceptions import OutOfMemoryError

from api.app import create_app
from shared import redis_keys
from shared.redis_server import RedisServer
from shared.settings import ApiSettings
from shared.tokenizer import Tokenizer

PREFIX = "full"


@pytest.fixture
def full_redis(tmp_path):
    """A redis-server of its own with a maxmemory and noeviction, as `streamq serve` starts it."""
    server = RedisServer(tmp_path / "redis", extra_args=["--maxmemory", "4mb", "--maxmemory-policy", "noeviction"])
    server.start()
    yield server
    server.stop()


def _fill(url: str) -> None:
    """Redis past its maxmemory: the limit lowered below what it holds (filling it to the brim is
    not steady: each refused write frees its own bytes again, and small writes then pass)."""
    with Redis.from_url(url) as client:
        client.config_set("maxmemory", 1)
        with pytest.raises(OutOfMemoryError):
            client.set("filler", b"x")


@pytest.mark.parametrize("path,body,shape", [
    ("/v1/completions", {"prompt": "a b", "max_tokens": 2}, "openai"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, "openai"),
    ("/v1/messages", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, "anthropic"),
    ("/v1/requests", {"prompt": "a b", "max_tokens": 2}, "native"),
])
def test_a_full_redis_answers_503_with_the_reason(full_redis, tiny_llama, path, body, shape):
    settings = ApiSettings(_env_file=None, redis_url=full_redis.url, prefix=PREFIX, model=str(tiny_llama),
                           served_model_name="m", auth="off")
    with TestClient(create_app(settings, Tokenizer(tiny_llama)), base_url="http://127.0.0.1") as client:
        _fill(full_redis.url)
        reply = client.post(path, json=body)
    assert reply.status_code == 503, reply.text
    assert reply.headers["Retry-After"] == "5"
    error = reply.json()
    message = {"openai": lambda: error["error"]["message"], "anthropic": lambda: error["error"]["message"],
               "native": lambda: error["detail"]}[shape]()
    assert "memory limit" in message
    if shape == "anthropic":
        assert error["type"] == "error" and error["error"]["type"] == "overloaded_error"
    if shape == "openai":
        assert error["error"]["code"] == "overloaded"
    with Redis.from_url(full_redis.url, decode_responses=True) as client:
        assert not list(client.scan_iter(match=redis_keys.request_record(PREFIX, "*")))


def test_the_server_still_answers_reads_when_full(full_redis, tiny_llama):
    settings = ApiSettings(_env_file=None, redis_url=full_redis.url, prefix=PREFIX, model=str(tiny_llama),
                           served_model_name="m", auth="off")
    with TestClient(create_app(settings, Tokenizer(tiny_llama)), base_url="http://127.0.0.1") as client:
        _fill(full_redis.url)
        assert client.get("/v1/requests/0b1c2d3e-1111-4222-8333-444455556666").status_code == 404
