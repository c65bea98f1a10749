"""The api never imports torch (nor transformers) and never loads weights."""
import json
import os
import subprocess
import sys

SCRIPT = """
import json, sys
from fastapi.testclient import TestClient
from api.app import create_app
from shared.settings import ApiSettings

with TestClient(create_app(ApiSettings()), base_url="http://127.0.0.1:8000") as client:
    accepted = client.post("/v1/requests", json={"prompt": "hello", "max_tokens": 3})
    chat = client.post("/v1/requests", json={"messages": [{"role": "user", "content": "hi"}]})
    poll = client.get(accepted.json()["links"]["self"])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "safetensors"))
print(json.dumps({"codes": [accepted.status_code, chat.status_code, poll.status_code], "heavy": heavy}))
"""


def test_api_serves_without_importing_torch(redis_url, tiny_llama, prefix):
    env = {**os.environ, "REDIS_URL": redis_url, "STREAMQ_MODEL": str(tiny_llama), "STREAMQ_PREFIX": prefix}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["codes"] == [202, 202, 200]
    assert result["heavy"] == []
