"""Intel's OpenMP runtime under the worker's torch threads, where the package is installed.

On a CPU shared with the api, Redis and the clients, torch's own (GNU) OpenMP threads lost
time at every barrier whenever another process ran: one stream through the whole stack
decoded at 22-24 tok/s, and at 30-33 with Intel's runtime preloaded, as vLLM's CPU docs
recommend for its own engine (W: 299-323 and 307-364 tok/s; bf16, 2 cores, one run each).
A runtime can only be chosen before the process loads torch, so the worker starts itself
again, once, with LD_PRELOAD set. STREAMQ_OPENMP=gnu keeps torch's own.
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
    """The environment to start the worker again in, or None to go on as it is: already
    preloaded, no runtime installed, or STREAMQ_OPENMP=gnu."""
    if lib is None or environ.get("STREAMQ_OPENMP", "intel") != "intel":
        return None
    preload = [p for p in environ.get("LD_PRELOAD", "").split(":") if p]
    if str(lib) in preload:
        return None
    return {**environ, "LD_PRELOAD": ":".join([str(lib), *preload])}


def restart_with_intel_openmp(argv: list[str] | None = None) -> None:
    """Replace this process (same pid; the CLI's arguments, or `argv`) by one with Intel's OpenMP
    preloaded. The benchmarks call it too, so they measure the runtime the worker runs on."""
    env = preload_env(os.environ, intel_openmp())
    if env is None or "torch" in sys.modules:  # torch already loaded its runtime: too late to choose
        return
    os.execve(sys.executable, argv or [sys.executable, "-m", "streamq.cli", *sys.argv[1:]], env)
