"""Where the time goes under a mid-size load: CPU seconds of each process of the stack, and the
worker's steps split by phase, over one run.

    .venv/bin/python benchmarks/time_split.py [--rate 2] [--num-prompts 32] [--max-tokens 128]

The whole stack (a private redis-server, one worker, one api replica; default model, batch 32)
gets --num-prompts chat prompts of workload W as a Poisson process at --rate (about 8 to 16
requests running at once at the default rate on a 2-core machine), through `streamq bench`.
Before and after, it reads each process's CPU time (/proc/PID/stat: user + system) and the
worker's `streamq:step_phase_seconds` (arrivals, schedule, forward, sample, publish) and
`streamq:step_duration_seconds`; it prints both splits, the load's percentiles and lscpu's model
and flags. Extra STREAMQ_* settings: --env K=V ...
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.backends import descendants
from streamq.stack import local_stack
from benchmarks.report import cpu_flags, cpu_model, print_table
from streamq import bench

W = ROOT / "benchmarks" / "workload_w.json"
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def role(pid: int) -> str | None:
    """Which process of the stack `pid` is: redis, worker or api (None for anything else)."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()  # redis rewrites its cmdline, not its comm
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    if comm == "redis-server":
        return "redis-server"
    words = [w.decode(errors="replace") for w in cmdline if w]
    for name in ("worker", "api"):
        if "streamq.cli" in words and name in words:
            return name
    return None


def processes() -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for pid in descendants():
        if (name := role(pid)) is not None:
            found.setdefault(name, []).append(pid)
    return found


def cpu_by_role(pids: dict[str, list[int]]) -> dict[str, float]:
    return {name: sum(cpu_seconds(pid) for pid in group) for name, group in pids.items()}


def worker_samples(client: httpx.Client, url: str) -> dict[str, float]:
    samples = {}
    for family in text_string_to_metric_families(client.get(url).text):
        for sample in family.samples:
            if sample.name == "streamq:step_phase_seconds_total":
                samples[sample.labels["phase"]] = sample.value
            elif sample.name in ("streamq:step_duration_seconds_sum", "streamq:step_duration_seconds_count",
                                 "streamq:generation_tokens_total"):
                samples[sample.name] = sample.value
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--env", nargs="*", default=[], help="extra STREAMQ_* settings, K=V")
    args = parser.parse_args()
    settings = {"STREAMQ_BATCH_SIZE": "32", **dict(kv.split("=", 1) for kv in args.env)}
    load = argparse.ArgumentParser()
    bench.add_arguments(load)
    with local_stack("time-split", settings, timeout_s=600) as url, httpx.Client(timeout=30) as client:
        [worker] = client.get(f"{url}/readyz").json()["workers"]
        metrics = f"http://127.0.0.1:{worker['metrics_port']}/metrics"
        model = worker["model"]
        common = ["--url", url, "--endpoint", "openai-chat", "--model", model, "--prompts", str(W), "--ignore-eos",
                  "--temperature", "0", "--quiet"]
        asyncio.run(bench.run(load.parse_args(common + ["--num-prompts", "2", "--max-tokens", "8"])))  # warm-up
        pids = processes()
        cpu0, steps0, wall0 = cpu_by_role(pids), worker_samples(client, metrics), os.times().elapsed
        report = asyncio.run(bench.run(load.parse_args(
            common + ["--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens),
                      "--request-rate", str(args.rate)])))
        cpu1, steps1, wall1 = cpu_by_role(pids), worker_samples(client, metrics), os.times().elapsed
    wall = wall1 - wall0
    client_cpu = sum(os.times()[:2])  # this process (the load client) over its whole life, warm-up included
    rows = [[name, round(cpu1[name] - cpu0[name], 2), f"{(cpu1[name] - cpu0[name]) / wall:.2f}"] for name in cpu0]
    rows.append(["load client (streamq bench, whole life)", round(client_cpu, 2), "-"])
    print(f"\nrate {args.rate} req/s, {args.num_prompts} chat prompts, {args.max_tokens} tokens each: "
          f"{report['output_tokens_per_s']} tok/s, TTFT p50/p90/p99 {report['ttft_ms']['p50']} / "
          f"{report['ttft_ms']['p90']} / {report['ttft_ms']['p99']} ms, TPOT p50/p90/p99 {report['tpot_ms']['p50']} / "
          f"{report['tpot_ms']['p90']} / {report['tpot_ms']['p99']} ms, wall {wall:.1f} s\n")
    print_table(["process", "CPU seconds", "cores busy (CPU s / wall s)"], rows)
    steps = {k: steps1.get(k, 0.0) - steps0.get(k, 0.0) for k in steps1}
    count = steps["streamq:step_duration_seconds_count"]
    total = steps["streamq:step_duration_seconds_sum"]
    phases = ["arrivals", "schedule", "forward", "sample", "publish"]
    print(f"\n{count:.0f} steps, {steps['streamq:generation_tokens_total']:.0f} tokens; a step's mean "
          f"{1000 * total / max(count, 1):.2f} ms (from handing it to the model thread to its outputs back)\n")
    print_table(["phase", "seconds", "ms a step", "share of steps + publish"],
                [[p, round(steps.get(p, 0.0), 3), round(1000 * steps.get(p, 0.0) / max(count, 1), 3),
                  f"{steps.get(p, 0.0) / (total + steps.get('publish', 0.0)):.1%}"] for p in phases])
    print(f"\nMachine: {cpu_model()}, {os.cpu_count()} cores (flags: {' '.join(cpu_flags())})")


if __name__ == "__main__":
    main()
