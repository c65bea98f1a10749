"""The whole stack (worker, scheduler, api) on a Redis that requires a password and speaks only TLS,
and the password in none of their logs."""
from pathlib import Path

import httpx
import pytest

from tests.e2e.helpers import submit, wait_done
from tests.redis_tls import SecureRedis, make_certs
from tests.stack import Stack


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("redis-tls")
    running = SecureRedis(folder / "redis", make_certs(folder / "certs")).start()  # --port 0: TLS only
    yield running
    running.stop()


def _serve_one_request(server: SecureRedis, redis_url: str, model: Path, folder: Path, env: dict[str, str]) -> None:
    try:
        with Stack(redis_url, model, folder, scheduler=True, env=env) as stack, httpx.Client(timeout=60) as client:
            api = stack.urls[0]
            state = wait_done(client, api, submit(client, api, prompt="hi", max_tokens=5)["id"], timeout_s=60)
            assert state["status"] == "done" and state["completion_tokens"] >= 1, state
    finally:  # also when the stack failed to start: its logs must not hold the password either
        logs = {p.name: p.read_text(errors="replace") for p in folder.rglob("*.log")}
        assert logs and not [name for name, text in logs.items() if server.password in text]


def test_the_stack_over_tls_with_a_trusted_ca(server, tiny_llama, tmp_path):
    """rediss://:password@host:port/0, the server's CA trusted by the processes (SSL_CERT_FILE, as a CA in
    the system store would be)."""
    _serve_one_request(server, server.tls_url(query=""), tiny_llama, tmp_path / "stack",
                       {"SSL_CERT_FILE": str(server.certs.ca)})


def test_the_stack_over_tls_with_the_ca_in_redis_url(server, tiny_llama, tmp_path):
    """rediss://:password@host:port/0?ssl_ca_certs=/path/ca.pem, no other configuration."""
    _serve_one_request(server, server.tls_url(), tiny_llama, tmp_path / "stack", {})
