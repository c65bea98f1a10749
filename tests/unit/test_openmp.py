"""When the worker starts itself again with Intel's OpenMP preloaded (worker/openmp.py)."""
from pathlib import Path

from worker.openmp import preload_env

LIB = Path("/venv/lib/libiomp5.so")


def test_the_runtime_goes_first_in_ld_preload_once():
    env = preload_env({"PATH": "/bin", "LD_PRELOAD": "/other.so"}, LIB)
    assert env == {"PATH": "/bin", "LD_PRELOAD": f"{LIB}:/other.so"}
    assert preload_env(env, LIB) is None  # the restarted worker goes on


def test_no_restart_without_the_runtime_or_when_told_not_to():
    assert preload_env({}, None) is None
    assert preload_env({"STREAMQ_OPENMP": "gnu"}, LIB) is None
    assert preload_env({}, LIB) == {"LD_PRELOAD": str(LIB)}
