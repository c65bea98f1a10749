"""Start a private redis-server on a free port (for `streamq serve` and the tests)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from shared.children import die_with_parent, terminate

INSTALL_HINT = ("redis-server is not installed. Install it (Debian/Ubuntu: `sudo apt-get install redis-server`; "
                "`make run` and `make test` do this when run as root), or set REDIS_URL to a Redis you run.")


def default_maxmemory_mb() -> int:
    """A private Redis's memory limit when none is set: a quarter of the machine's RAM, at least 256 MiB."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(256, total // 4 // 2**20)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server child process bound to 127.0.0.1, with its files in `folder`."""

    def __init__(self, folder: Path, appendonly: bool = False, appendfsync: str = "everysec",
                 own_session: bool = False, extra_args: list[str] | None = None, maxmemory_mb: int | None = None):
        """`extra_args`: more redis-server options (a cluster node's, in the tests). `maxmemory_mb`:
        its memory limit, with noeviction (a write past it is refused; nothing stored is evicted)."""
        self.folder = folder
        self.extra_args = extra_args or []
        self.maxmemory_mb = maxmemory_mb
        if maxmemory_mb is not None:
            self.extra_args += ["--maxmemory", f"{maxmemory_mb}mb", "--maxmemory-policy", "noeviction"]
        # own_session: out of the terminal's process group, so a Ctrl-C reaches only the process
        # that stops it last (after the workers have finished with it); it still dies with that one.
        self.own_session = own_session
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.port = 0
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> str:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(INSTALL_HINT)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        self.process = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.folder),
             "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", self.appendfsync,
             "--logfile", str(self.folder / "redis.log"), *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            start_new_session=self.own_session, preexec_fn=die_with_parent if self.own_session else None)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # wait until it accepts connections
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}; see {self.folder}/redis.log")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return self.url
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s} s")

    def kill(self) -> None:
        """SIGKILL the server (a crash); start() brings it back on the same port from its files."""
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def crash_and_restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        terminate(self.process, 5)
