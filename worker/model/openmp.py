"""Intel's OpenMP runtime under the worker's torch threads, where the package is installed.

On a CPU shared with the api, Redis and the clients, torch's own (GNU) OpenMP threads lost
time at every barrier whenever another process ran: one stream through the whole stack
decoded at 22-24 tok/s, and at 30-33 with Intel's runtime preloaded, as vLLM's CPU docs
recommend for its own engine (W: 299-323 and 307-364 tok/s; bf16, 2 cores, one run each).
A runtime can only be chosen before the process loads torch, so the worker starts itself
again, once, with LD_PRELOAD set. STREAMQ_OPENMP=gnu keeps torch's own.

The same restart asks glibc's malloc for transparent huge pages (GLIBC_TUNABLES=
glibc.malloc.hugetlb=1; glibc 2.35 on, where the kernel's THP mode is `madvise` or `always`):
the weights then sit in 2 MB pages. One stream, which reads every weight each step, decoded at
77.6, 81.0 and 77.9 tok/s against 74.1, 72.4 and 71.0 with 4 KB pages (bf16, 2 cores, three
alternating runs of benchmarks/engine.py); a batch of 32 moved within noise. A GLIBC_TUNABLES
already set is left as it is.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path


def intel_openmp() -> Path | None:
    """libiomp5.so of the `intel-openmp` package in this environment, if it is installed."""
    lib = Path(sys.prefix) / "lib" / "libiomp5.so"
    return lib if lib.is_file() else None


def preload_env(environ: Mapping[str, str], lib: Path | None) -> dict[str, str] | None:
    """The environment to start the worker again in (Intel's OpenMP preloaded unless it is not
    installed or STREAMQ_OPENMP=gnu; malloc's huge pages unless GLIBC_TUNABLES is set), or None
    to go on as it is."""
    env = dict(environ)
    if lib is not None and environ.get("STREAMQ_OPENMP", "intel") == "intel":
        preload = [p for p in environ.get("LD_PRELOAD", "").split(":") if p]
        if str(lib) not in preload:
            env["LD_PRELOAD"] = ":".join([str(lib), *preload])
    env.setdefault("GLIBC_TUNABLES", HUGE_PAGES)
    return None if env == environ else env


HUGE_PAGES = "glibc.malloc.hugetlb=1"


def restart_with_intel_openmp(argv: list[str] | None = None) -> None:
    """Replace this process (same pid; the CLI's arguments, or `argv`) by one with Intel's OpenMP
    preloaded and malloc's huge pages. The benchmarks call it too, so they measure the process
    the worker runs as."""
    env = preload_env(os.environ, intel_openmp())
    if env is None or "torch" in sys.modules:  # torch already loaded its runtime: too late to choose
        return
    os.execve(sys.executable, argv or [sys.executable, "-m", "streamq.cli", *sys.argv[1:]], env)
