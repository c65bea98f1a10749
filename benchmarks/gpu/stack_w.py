"""Workload W through the whole stack on one model folder, device and dtype; one markdown table.

    python benchmarks/gpu/stack_w.py --model FOLDER --device cuda --dtype bfloat16 --batch-size 64

A private redis-server, one worker (the built-in backend) and one api replica
(streamq/stack.py's local_stack), loaded by `streamq bench --endpoint native` with W's prompts sent at
once (greedy, ignore_eos, a fixed number of new tokens), after a short warm-up. On CUDA it runs
twice, decode from CUDA graphs (the default) and eager (STREAMQ_CUDA_GRAPHS=false), one after the
other, and reports the ratio. benchmarks/gpu_check.sh runs it; it works on any device.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from streamq.stack import local_stack
from streamq import bench

W = ROOT / "benchmarks" / "workload_w.json"


def run_w(args: argparse.Namespace, graphs: bool) -> dict:
    settings = {"STREAMQ_MODEL": str(args.model), "STREAMQ_BACKEND": "hf", "STREAMQ_DEVICE": args.device,
                "STREAMQ_DTYPE": args.dtype, "STREAMQ_BATCH_SIZE": str(args.batch_size),
                "STREAMQ_MAX_NUM_BATCHED_TOKENS": str(args.max_num_batched_tokens),
                "STREAMQ_KV_CACHE_GB": str(args.kv_cache_gb), "STREAMQ_CUDA_GRAPHS": str(graphs).lower()}
    with local_stack("gpu-check", settings, timeout_s=args.ready_timeout) as url:
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        common = ["--url", url, "--endpoint", "native", "--prompts", str(W), "--ignore-eos", "--quiet"]
        asyncio.run(bench.run(parser.parse_args(common + ["--num-prompts", "4", "--max-tokens", "4"])))  # warm-up
        return asyncio.run(bench.run(parser.parse_args(
            common + ["--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens)])))


def table(args: argparse.Namespace, reports: dict[str, dict]) -> str:
    expected = args.num_prompts * args.max_tokens
    rows = [
        "| backend | device | dtype | weights | decode | batch | requests x new tokens | tokens streamed | "
        "output tok/s | TTFT p50 | TTFT p99 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for decode, report in reports.items():
        ttft = report["ttft_ms"]
        rows.append(
            f"| built-in (hf) | {args.device_name} | {args.dtype} | {args.weights} | {decode} | {args.batch_size} | "
            f"{args.num_prompts} x {args.max_tokens} | {report['received_tokens']:,} of {expected:,} | "
            f"**{report['output_tokens_per_s']:.1f}** | {ttft['p50'] / 1000:.3f} s | {ttft['p99'] / 1000:.3f} s |")
    if len(reports) == 2:
        graphs, eager = (r["output_tokens_per_s"] for r in reports.values())
        rows.append(f"\nCUDA graphs / eager, measured in this run: **{graphs / eager:.2f}x**")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a model folder (config, weights, tokenizer)")
    parser.add_argument("--weights", default="random", help="what the table says about the weights")
    parser.add_argument("--device", default="cuda", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--device-name", default=None, help="what the table says about the device")
    parser.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--kv-cache-gb", type=float, default=16.0)
    parser.add_argument("--num-prompts", type=int, default=32, help="W has 32 prompts")
    parser.add_argument("--max-tokens", type=int, default=64, help="W asks 64 new tokens of each")
    parser.add_argument("--ready-timeout", type=float, default=180.0, help="seconds for the stack to become ready")
    parser.add_argument("--json", type=Path, help="write the bench report here")
    args = parser.parse_args()
    args.device_name = args.device_name or args.device
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's TERM still stops the stack
    cuda = args.device == "cuda"
    variants = {"CUDA graphs": True, "eager": False} if cuda else {"CPU (no graphs)": False}
    reports = {}
    for decode, graphs in variants.items():
        reports[decode] = run_w(args, graphs)
        reports[decode].pop("config", None)
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1))
    print(table(args, reports))
    expected = args.num_prompts * args.max_tokens
    complete = True
    for decode, report in reports.items():
        if not (report["failed"] == 0 and report["output_tokens"] == report["received_tokens"] == expected):
            print(f"W ({decode}) did not complete: {report['failed']} failed {report['errors']}", file=sys.stderr)
            complete = False
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
