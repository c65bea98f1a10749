"""The machine's memory bandwidth, STREAM's way: the triad a = b + s * c over arrays far larger than
the caches, best of several passes, bytes counted as STREAM counts them (two arrays read, one
written: 12 bytes an fp32 element; the write's allocation read not counted). Also a read-only
pass (a sum over one array), closer to what a decode step does with its weights.

    .venv/bin/python benchmarks/bandwidth.py [--mib 512] [--passes 5]

One thread and every thread (torch's own OpenMP pool). Other benchmarks import `measure` to print
the limit beside a one-stream figure (benchmarks/gguf_peers.py).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import cpu_flags, cpu_model, print_table


@dataclass
class Bandwidth:
    threads: int
    triad_gbs: float  # GB/s (1e9 bytes), STREAM's count
    read_gbs: float  # GB/s of one array summed


def measure(threads: int, mib: int = 512, passes: int = 5) -> Bandwidth:
    """Best of `passes` over arrays of `mib` MiB each, on `threads` threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = mib * 2**20 // 4
        a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
        a.zero_()
        triad, read = float("inf"), float("inf")
        for _ in range(passes):
            start = time.perf_counter()
            torch.add(b, c, alpha=3.0, out=a)
            triad = min(triad, time.perf_counter() - start)
            start = time.perf_counter()
            b.sum()
            read = min(read, time.perf_counter() - start)
        return Bandwidth(threads, 3 * 4 * n / triad / 1e9, 4 * n / read / 1e9)
    finally:
        torch.set_num_threads(before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512, help="each array's size")
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()
    import torch

    counts = sorted({1, torch.get_num_threads()})
    found = [measure(t, args.mib, args.passes) for t in counts]
    print_table(["threads", "triad GB/s", "read GB/s"], [[b.threads, f"{b.triad_gbs:.1f}", f"{b.read_gbs:.1f}"]
                                                          for b in found])
    print(f"\nMachine: {cpu_model()} (flags: {' '.join(cpu_flags())}); arrays of {args.mib} MiB, best of "
          f"{args.passes}")


if __name__ == "__main__":
    main()
