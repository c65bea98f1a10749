"""A private redis-server with a password and TLS, its CA made at test time with the `openssl` CLI."""
from __future__ import annotations

import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from shared.children import terminate
from shared.redis_server import free_port

_SERVER_EXT = ("basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
               "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n"
               "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n")


@dataclass(frozen=True)
class Certs:
    ca: Path
    cert: Path
    key: Path


def make_certs(folder: Path) -> Certs:
    """A throwaway CA and a server certificate for 127.0.0.1 and localhost signed by it (EC P-256, 1 day)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is not installed")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "server.ext").write_text(_SERVER_EXT)
    new_key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for args in (
        ["req", "-x509", *new_key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=streamq test CA",
         "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        ["req", *new_key, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-set_serial", "1", "-days", "1",
         "-extfile", "server.ext", "-out", "server.pem"],
    ):
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)
    return Certs(folder / "ca.pem", folder / "server.pem", folder / "server.key")


class SecureRedis:
    """redis-server on 127.0.0.1 that requires a random password: TLS on `tls_port`, plain text on `port`
    only when `plain` (otherwise `--port 0`: no plain-text listener at all)."""

    def __init__(self, folder: Path, certs: Certs, plain: bool = False):
        self.folder, self.certs = folder, certs
        self.password = secrets.token_hex(16)
        self.tls_port = free_port()
        self.port = free_port() if plain else 0
        self.process: subprocess.Popen | None = None

    def tls_url(self, password: str | None = None, query: str | None = None) -> str:
        """rediss:// with the password and the CA that verifies the server, as REDIS_URL takes it."""
        query = query if query is not None else f"ssl_ca_certs={quote(str(self.certs.ca))}"
        return f"rediss://:{self._quoted(password)}@127.0.0.1:{self.tls_port}/0?{query}"

    def plain_url(self, port: int | None = None, password: str | None = None) -> str:
        return f"redis://:{self._quoted(password)}@127.0.0.1:{port or self.port}/0"

    def _quoted(self, password: str | None) -> str:
        return quote(self.password if password is None else password, safe="")  # percent-encoded, as URLs need

    def start(self, timeout_s: float = 10.0) -> SecureRedis:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--tls-port", str(self.tls_port),
             "--tls-cert-file", str(self.certs.cert), "--tls-key-file", str(self.certs.key),
             "--tls-ca-cert-file", str(self.certs.ca), "--tls-auth-clients", "no", "--requirepass", self.password,
             "--dir", str(self.folder), "--save", "", "--appendonly", "no",
             "--logfile", str(self.folder / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with redis.Redis.from_url(self.tls_url(), socket_timeout=1) as client:
            while True:  # until it answers over TLS with the password
                if self.process.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.process.returncode}:\n"
                                       f"{(self.folder / 'redis.log').read_text(errors='replace')[-2000:]}")
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)  # readiness polling only

    def stop(self) -> None:
        terminate(self.process, 5)
