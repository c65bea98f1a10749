"""When the worker starts itself again with Intel's OpenMP preloaded and malloc's huge pages
(worker/model/openmp.py)."""
from pathlib import Path

from worker.model.openmp import HUGE_PAGES, preload_env

LIB = Path("/venv/lib/libiomp5.so")


def test_the_runtime_goes_first_in_ld_preload_once():
    env = preload_env({"PATH": "/bin", "LD_PRELOAD": "/other.so"}, LIB)
    assert env == {"PATH": "/bin", "LD_PRELOAD": f"{LIB}:/other.so", "GLIBC_TUNABLES": HUGE_PAGES}
    assert preload_env(env, LIB) is None  # the restarted worker goes on


def test_no_runtime_without_the_package_or_when_told_not_to():
    assert preload_env({}, None) == {"GLIBC_TUNABLES": HUGE_PAGES}
    assert preload_env({"STREAMQ_OPENMP": "gnu"}, LIB) == {"STREAMQ_OPENMP": "gnu", "GLIBC_TUNABLES": HUGE_PAGES}
    assert preload_env({}, LIB) == {"LD_PRELOAD": str(LIB), "GLIBC_TUNABLES": HUGE_PAGES}


def test_a_glibc_tunable_already_set_is_kept():
    assert preload_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, None) is None
    env = preload_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, LIB)
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "LD_PRELOAD": str(LIB)}
