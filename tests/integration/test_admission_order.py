"""A tenant past its limits is refused before any CPU work on its request: its 429 comes before the
body's constraint is compiled (a schema llguidance refuses would otherwise be a 400) and before its
prompt is tokenized. Real Redis, the real app, keys on."""
from fastapi.testclient import TestClient

from api.app import create_app
from api.core.limits import Limits
from shared.api_keys import KeyStore
from shared.settings import ApiSettings

# A pattern llguidance cannot compile: read with the body, it is a 400 naming the field.
BROKEN = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(unclosed"}}}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": BROKEN}


async def test_an_over_limit_request_is_refused_before_its_body_costs_anything(redis, redis_url, prefix, tiny_llama,
                                                                                counted_tokenizer):
    tokenizer, calls = counted_tokenizer
    key = await KeyStore(redis, prefix).create("flooder")
    await Limits(redis, prefix, 3600).set("flooder", rpm=1)
    settings = ApiSettings(_env_file=None, redis_url=redis_url, prefix=prefix, model=str(tiny_llama),
                           served_model_name="m", auth="on")
    headers = {"Authorization": f"Bearer {key}"}
    with TestClient(create_app(settings, tokenizer), base_url="http://127.0.0.1") as client:
        # Within the limit, the broken schema is read and refused for what it is (nothing charged).
        refused = client.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert refused.status_code == 400 and "response_format" in refused.text + refused.json()["error"]["param"]
        # The one request of the minute.
        queued = client.post("/v1/requests", json={"prompt": "a b", "max_tokens": 2}, headers=headers)
        assert queued.status_code == 202, queued.text
        calls.clear()
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "a " * 500}),
                           ("/v1/requests", {"prompt": "a b"}), ("/v1/embeddings", {"input": ["a", "b"]}),
                           ("/tokenize", {"prompt": "a " * 500})):
            over = client.post(path, json=body, headers=headers)
            assert over.status_code == 429, (path, over.text)
            assert "requests per minute" in over.text and int(over.headers["Retry-After"]) >= 1
        assert calls == []  # no prompt was tokenized for any of them
