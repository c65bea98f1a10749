"""Latency under load: each server swept over request rates, light to past saturation, in one run;
percentiles and goodput at every rate.

    .venv/bin/python benchmarks/load_sweep.py                      # every pair below
    .venv/bin/python benchmarks/load_sweep.py --pairs gguf --rates 0.5 1 2 --num-prompts 24

Two pairs, each on the same weights in the same format:
- `fp32`: streamq with the default model dequantized to fp32 (STREAMQ_GGUF_WEIGHTS=dequantized,
  STREAMQ_DTYPE=float32) against vLLM's CPU server on that folder in fp32, run as its CPU docs
  recommend (benchmarks/backends.py: compiled, OpenMP threads bound to every core, tcmalloc and
  Intel OpenMP preloaded, the same batch and step budget); needs .venv-vllm (make vllm-env);
- `gguf`: streamq serving the default model's GGUF as stored (quantized) against llama.cpp's
  `llama-server` on the same file with parallel slots and continuous batching
  (benchmarks/gguf_peers.py, scripts/llama-cpp.sh).

At each rate, `streamq bench` sends --num-prompts chat prompts (benchmarks/workload_w.json) as a
Poisson process (--burstiness 1), --max-tokens each, greedy, ignore_eos, on the OpenAI chat
endpoint, and reports TTFT, TPOT, ITL and E2E at p50/p90/p99, output tok/s and goodput under
--slo (default TTFT <= 1 s and TPOT <= 150 ms). Servers of a pair run one after the other (each
started, swept, stopped), so neither takes CPU from the other. Prints a table per pair and
lscpu's model and flags; --json keeps every report.

--rounds N sweeps every server N times, the order of a pair's servers swapped each round (a
server that runs second in one round runs first in the next), and adds the spread: each
round's goodput and TPOT p50 at every rate, the ratio of the pair's two servers in each round,
and their medians, so that a ratio is read against this machine's run-to-run noise.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.backends import BATCH, BUDGET, KV_CACHE_GB, vllm_serve
from benchmarks.gguf_peers import llama_server
from streamq.stack import local_stack
from benchmarks.report import cpu_flags, cpu_model, print_table
from shared.model_paths import prepare_model, weights_dir
from shared.model_source import default_gguf_path, served_name
from shared.settings import WorkerSettings
from streamq import bench

W = ROOT / "benchmarks" / "workload_w.json"
LLAMA_SLOT_CONTEXT = 1024  # tokens per llama-server slot: a W prompt and 128 new tokens fit


def sweep(url: str, model: str, args) -> list[dict]:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    common = ["--url", url, "--endpoint", "openai-chat", "--model", model, "--prompts", str(W), "--ignore-eos",
              "--temperature", "0", "--quiet", "--timeout", "1800", "--goodput", *args.slo]
    asyncio.run(bench.run(parser.parse_args(common + ["--num-prompts", "2", "--max-tokens", "8"])))  # warm-up
    reports = []
    for rate in args.rates:
        report = asyncio.run(bench.run(parser.parse_args(
            common + ["--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens),
                      "--request-rate", str(rate), "--burstiness", str(args.burstiness), "--seed", str(args.seed)])))
        report.pop("config", None)
        report["rate"] = rate
        print(f"#   {rate} req/s: {report['output_tokens_per_s']} tok/s, TPOT p50 {report['tpot_ms']['p50']} ms, "
              f"goodput {report['goodput']['requests_per_s']} req/s", file=sys.stderr)
        reports.append(report)
    return reports


def servers(pair: str) -> list[tuple[str, Callable[[], AbstractContextManager], str]]:
    """(system, a context manager yielding its URL, the model name it serves) for each side of `pair`."""
    settings = WorkerSettings()
    name = served_name(settings)
    stack = {"STREAMQ_BATCH_SIZE": str(BATCH), "STREAMQ_MAX_NUM_BATCHED_TOKENS": str(BUDGET),
             "STREAMQ_DTYPE": "float32", "STREAMQ_KV_CACHE_GB": str(KV_CACHE_GB)}
    if pair == "fp32":
        prepare_model(settings)  # the dequantized fp32 folder vLLM loads, and streamq with the setting below
        fp32 = {**stack, "STREAMQ_GGUF_WEIGHTS": "dequantized"}
        return [("streamq fp32", lambda: local_stack("sweep-fp32", fp32, timeout_s=900), name),
                ("vLLM fp32", lambda: vllm_serve(weights_dir(settings), name, "float32", {}), name)]
    gguf = default_gguf_path()

    @contextmanager
    def llama() -> Iterator[str]:
        with llama_server(gguf, BATCH, LLAMA_SLOT_CONTEXT) as (url, _pid):
            yield url
    return [("streamq GGUF", lambda: local_stack("sweep-gguf", stack, timeout_s=900), name),
            ("llama.cpp GGUF", llama, "model")]


def table(results: dict[str, list[dict]]) -> None:
    rows = []
    for system, reports in results.items():
        for r in reports:
            t, p, e = r["ttft_ms"], r["tpot_ms"], r["e2e_ms"]
            rows.append([r["rate"], system, f"{t['p50']} / {t['p90']} / {t['p99']}",
                         f"{p['p50']} / {p['p90']} / {p['p99']}", f"{r['itl_ms']['p50']} / {r['itl_ms']['p99']}",
                         round(e["p50"] / 1000, 1), r["output_tokens_per_s"], r["goodput"]["requests_per_s"],
                         f"{r['goodput']['requests_met']}/{r['completed'] + r['failed']}"])
    rows.sort(key=lambda row: row[0])
    print_table(["rate req/s", "system", "TTFT p50/p90/p99 ms", "TPOT p50/p90/p99 ms", "ITL p50/p99 ms",
                 "E2E p50 s", "tok/s", "goodput req/s", "met SLO"], rows)


def spread(rounds: dict[str, list[list[dict]]], metric: Callable[[dict], float]) -> list[dict]:
    """Per rate, a metric of each server in each round and the first server's over the second's,
    round by round, with medians. `rounds`: system -> one list of reports (one a rate) a round,
    the first system being the one the ratio is taken of; pure, so it can be tested."""
    (ours, theirs) = list(rounds)
    rows = []
    for i, report in enumerate(rounds[ours][0]):
        a = [metric(r[i]) for r in rounds[ours]]
        b = [metric(r[i]) for r in rounds[theirs]]
        ratios = _ratios(a, b)
        rows.append({"rate": report["rate"], ours: a, theirs: b, "ratios": ratios,
                     "median_ratio": statistics.median(ratios)})
    return rows


def best_rate_ratios(rounds: dict[str, list[list[dict]]]) -> list[float]:
    """Each round's goodput at the first server's best rate over the second's at its own."""
    (ours, theirs) = ([max(r["goodput"]["requests_per_s"] for r in reports) for reports in sweeps]
                      for sweeps in rounds.values())
    return _ratios(ours, theirs)


def _ratios(ours: list[float], theirs: list[float]) -> list[float]:
    """Round by round, ours over theirs; inf where theirs is 0 (a peer that met no target)."""
    return [x / y if y else float("inf") for x, y in zip(ours, theirs, strict=True)]


def spread_tables(rounds: dict[str, list[list[dict]]]) -> None:
    (ours, theirs) = list(rounds)

    def cells(values: list[float]) -> str:
        return ", ".join(f"{v:g}" for v in values)
    for title, metric in (("goodput req/s", lambda r: r["goodput"]["requests_per_s"]),
                          ("TPOT p50 ms", lambda r: r["tpot_ms"]["p50"])):
        print(f"\n{title}, each round (median):\n")
        print_table(["rate req/s", ours, theirs, f"{ours} / {theirs}, each round", "median ratio",
                     "ratio min - max"],
                    [[row["rate"], f"{cells(row[ours])} ({statistics.median(row[ours]):g})",
                      f"{cells(row[theirs])} ({statistics.median(row[theirs]):g})",
                      cells([round(x, 2) for x in row["ratios"]]), round(row["median_ratio"], 2),
                      f"{min(row['ratios']):.2f} - {max(row['ratios']):.2f}"]
                     for row in spread(rounds, metric)])
    best = best_rate_ratios(rounds)
    print(f"\nGoodput at the best rate of each, {ours} / {theirs}, each round: "
          f"{cells([round(x, 2) for x in best])}; median {statistics.median(best):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", nargs="+", choices=["fp32", "gguf"], default=["fp32", "gguf"])
    parser.add_argument("--rates", nargs="+", type=float, default=[0.5, 1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--burstiness", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="the same arrival times for every server")
    parser.add_argument("--slo", nargs="+", default=["ttft:1000", "tpot:150"], help="goodput's targets, NAME:MS")
    parser.add_argument("--rounds", type=int, default=1, help="sweep every server this often, order swapped each round")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    bench.parse_goodput(args.slo)  # a bad target stops here, not after the first server started
    everything: dict[str, dict[str, list[list[dict]]]] = {}
    for round_ in range(args.rounds):
        for pair in args.pairs:
            sides = servers(pair)
            rounds = everything.setdefault(pair, {system: [] for system, _, _ in sides})
            for system, start, model in (sides if round_ % 2 == 0 else list(reversed(sides))):
                print(f"# round {round_ + 1}: {system}", file=sys.stderr)
                with start() as url:
                    rounds[system].append(sweep(url, model, args))
    for pair, rounds in everything.items():
        for round_ in range(args.rounds):
            print(f"\n**{pair}**{f', round {round_ + 1}' if args.rounds > 1 else ''}: {args.num_prompts} chat "
                  f"prompts a rate, {args.max_tokens} tokens each, Poisson arrivals (burstiness {args.burstiness}), "
                  f"batch {BATCH}, step budget {BUDGET}; SLO {' '.join(args.slo)}\n")
            table({system: reports[round_] for system, reports in rounds.items()})
        if args.rounds > 1:
            spread_tables(rounds)
    print(f"\nMachine: {cpu_model()}, {os.cpu_count()} cores (flags: {' '.join(cpu_flags())})")
    if args.json:
        args.json.write_text(json.dumps({"results": everything, "cpu": cpu_model(), "flags": cpu_flags(),
                                         "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))


if __name__ == "__main__":
    main()
