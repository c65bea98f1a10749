"""Child processes that outlive neither their parent nor a Ctrl-C meant for the parent only."""
from __future__ import annotations

import ctypes
import signal
import subprocess

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when the process that started it dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def terminate(process: subprocess.Popen | None, timeout_s: float) -> bool:
    """SIGTERM, then SIGKILL if it has not exited within timeout_s; True if it had to be killed."""
    if process is None or process.poll() is not None:
        return False
    process.terminate()
    try:
        process.wait(timeout_s)
        return False
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return True
