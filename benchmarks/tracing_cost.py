"""What tracing costs: workload W through the whole stack with tracing off, and on at full sampling
(every request traced, spans exported over OTLP/HTTP to a local receiver), in ONE run, alternating.

    .venv/bin/python benchmarks/tracing_cost.py [--rounds 4] [--repeat 3]

Each round starts a private stack (redis-server, one worker with batch 32 and a 2048-token budget,
one api replica; fp32) once with tracing off and once on, in swapped order every other round, and
loads it with `streamq bench --endpoint native` sending W's 32 prompts at once (64 tokens each,
greedy, ignore_eos), `--repeat` times (the median is the stack's figure: one W run lasts a few
seconds, and this machine's noise is larger than that). Prints each stack's output tokens/s, the
on/off ratio of the medians and of each round, and the spans the receiver got.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.full_stack import through_stack
from benchmarks.report import machine, print_machine
from streamq.testing.otlp_receiver import Receiver


def run(traced: Receiver | None, batch: int, budget: int, repeat: int) -> float:
    """The median output tokens/s of `repeat` W runs on a fresh stack, traced to `traced` if given."""
    extra = {"OTEL_EXPORTER_OTLP_ENDPOINT": traced.endpoint, "OTEL_TRACES_SAMPLER": "always_on"} if traced else {}
    return statistics.median(r["output_tokens_per_s"] for r in through_stack(batch, budget, extra, repeat))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3, help="W runs on each stack; the median is its figure")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()
    runs: dict[str, list[float]] = {"off": [], "on": []}
    with Receiver() as receiver:
        for round_ in range(args.rounds):
            order = ["off", "on"] if round_ % 2 == 0 else ["on", "off"]
            for mode in order:
                runs[mode].append(run(receiver if mode == "on" else None, args.batch_size,
                                      args.max_num_batched_tokens, args.repeat))
                print(f"# round {round_ + 1}, tracing {mode}: {runs[mode][-1]:.1f} tok/s", file=sys.stderr)
        spans = len(receiver.spans)
    ratio = statistics.median(runs["on"]) / statistics.median(runs["off"])
    rounds = [round(on / off, 3) for on, off in zip(runs["on"], runs["off"])]
    report = {"tok_per_s": runs, "on_over_off": round(ratio, 3), "on_over_off_by_round": rounds,
              "spans_received": spans,
              "machine": machine("float32", 2)}
    print(json.dumps(report, indent=1))
    print_machine(report["machine"])


if __name__ == "__main__":
    main()
