"""How a benchmark reports its results for docs/benchmarks.md: the machine it ran on and
markdown tables."""
from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterable
from pathlib import Path

# The vector and matrix extensions a CPU figure depends on (lscpu's flag names).
RELEVANT_FLAGS = re.compile(r"^(avx2|avx512.*|amx.*)$")


def print_table(headers: list[str], rows: Iterable[Iterable[object]]) -> None:
    print("| " + " | ".join(headers) + " |")
    print("|" + " --- |" * len(headers))
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")


def _cpuinfo(field: str) -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    match = re.search(rf"^{field}\s*:\s*(.*)$", text, re.MULTILINE)
    return match.group(1).strip() if match else ""


def cpu_model() -> str:
    """lscpu's model name (/proc/cpuinfo's where lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return _cpuinfo("model name") or "unknown"
    match = re.search(r"^Model name:\s*(.*)$", out, re.MULTILINE)
    return match.group(1).strip() if match else _cpuinfo("model name") or "unknown"


def cpu_flags() -> list[str]:
    """The CPU's avx2, avx512* and amx* flags, sorted."""
    return sorted(f for f in _cpuinfo("flags").split() if RELEVANT_FLAGS.match(f))


def cores() -> list[int]:
    """The CPUs this process may run on."""
    return sorted(os.sched_getaffinity(0))


def machine(dtype: str, threads: int, **extra: object) -> dict:
    """What a CPU figure depends on, for the report: CPU model and flags, torch version,
    threads and dtype (torch is imported here only if the caller has not)."""
    import torch  # a report helper should not force torch on import

    openmp = "intel" if "libiomp5" in os.environ.get("LD_PRELOAD", "") else "torch's own"
    return {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "cores": len(cores()), "torch": torch.__version__,
            "threads": threads, "dtype": dtype, "openmp": openmp, **extra}


def print_machine(facts: dict) -> None:
    """One markdown line under a table: the machine facts."""
    flags = " ".join(facts["cpu_flags"]) or "none of avx2/avx512/amx"
    rest = "; ".join(f"{k} {v}" for k, v in facts.items() if k not in ("cpu", "cpu_flags", "cores", "torch",
                                                                         "threads", "dtype"))
    print(f"\nMachine: {facts['cpu']}, {facts['cores']} cores (flags: {flags}); torch {facts['torch']}, "
          f"{facts['threads']} threads, {facts['dtype']}" + (f"; {rest}" if rest else ""))
