"""A grammar pool's compiles held where the test says (api/core/grammar_pool.py): each compile counts
itself, says it started, and waits for the test to release it, through two named pipes, so a
test knows a compile is running in a pool's process and for as long as it wants, with no timing."""
from __future__ import annotations

import functools
import os
import select
from pathlib import Path

from shared.structured import verdict


class Hold:
    def __init__(self, folder: Path):
        self.folder = folder
        os.mkfifo(folder / "started")
        os.mkfifo(folder / "release")
        # Both ends held open read-write here: a compile's opens never wait, its read of `release` does.
        self._started = os.open(folder / "started", os.O_RDWR)
        self._release = os.open(folder / "release", os.O_RDWR)
        self.check = functools.partial(held_verdict, str(folder))  # the pool's check; spawn pickles it by name

    def wait_started(self, bound_s: float = 60.0) -> None:
        """Until one more compile has started (fails, rather than hangs, after `bound_s`)."""
        readable, _, _ = select.select([self._started], [], [], bound_s)
        assert readable, f"no compile started within {bound_s} s"
        os.read(self._started, 1)

    def release(self, compiles: int = 1) -> None:
        """Let `compiles` held compiles (or the next ones to start) go on."""
        os.write(self._release, b"r" * compiles)

    def compiles(self) -> int:
        """How many compiles have started."""
        path = self.folder / "compiles"
        return len(path.read_text()) if path.exists() else 0

    def close(self) -> None:
        """Every compile still held goes on (its read of `release` ends)."""
        os.close(self._release)
        os.close(self._started)


def held_verdict(folder: str, constraint: str) -> str:
    """Count this compile, say it started, wait for its release; then the real verdict."""
    with open(os.path.join(folder, "compiles"), "a") as count:
        count.write("c")
    started = os.open(os.path.join(folder, "started"), os.O_WRONLY)
    os.write(started, b"s")
    os.close(started)
    release = os.open(os.path.join(folder, "release"), os.O_RDONLY)
    os.read(release, 1)
    os.close(release)
    return verdict(constraint)
