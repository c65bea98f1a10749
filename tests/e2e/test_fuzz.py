"""schemathesis against the live api's OpenAPI schema, on a bounded budget: no 5xx, and the
stack is still serving afterwards. (Its CLI, since its pytest plugin does not load under
pytest 9.)"""
import subprocess
import sys
from pathlib import Path

import httpx

SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"


def test_no_input_gets_a_server_error_and_the_stack_survives(stack, tmp_path):
    out = subprocess.run([str(SCHEMATHESIS), "run", f"{stack.urls[0]}/openapi.json", "--checks", "not_a_server_error",
                          "--max-examples", "5", "--seed", "20261130", "--request-timeout", "60",
                          "--no-color"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-4000:]
    assert "passed" in out.stdout and "Server error" not in out.stdout
    for name, proc in stack.processes:
        assert proc.poll() is None, f"{name} died"
    reply = httpx.post(f"{stack.urls[0]}/v1/requests", json={"prompt": "ok", "max_tokens": 2}, timeout=30)
    assert reply.status_code == 202
