"""Engine benchmark: workload W through this engine and the baselines, in ONE process run.

    .venv/bin/python benchmarks/engine.py                       # dtype: what dtype=auto picks here
    .venv/bin/python benchmarks/engine.py --dtype bfloat16 --modes matmul-ref,streamq,openvino,single
    .venv/bin/python benchmarks/engine.py --dtype float32 --weights as-served --modes streamq,single,openvino \
        --openvino-weights int4      # the default GGUF kept quantized against OpenVINO's int4

Workload W (benchmarks/workload_w.json): 32 chat-templated prompts sent at once, 64 new tokens
each, greedy, ignore_eos, on the default model. Modes:
  streamq      this engine (continuous batching, paged KV cache), in-process
  streamq-eager  the same without its compiled CPU step kernels (worker/model/kernels.py): eager torch ops
  seed         the seed tutorial's design: static batches of 4, no KV cache (the whole sequence
               is recomputed every step)
  hf-generate  transformers `generate`, one request at a time
  hf-batch     transformers' own continuous batching (`generate_batch`)
  matmul-ref   the model's matmuls alone (every layer's weights and the lm_head, so each decode
               step streams all the weights as the real model does), W's prefill + 64 steps at
               batch 32; with it, the GEMM-peak limit: W's FLOPs at this machine's large-GEMM rate
               (benchmarks/matmul_ref.py)
  openvino     OpenVINO GenAI's ContinuousBatchingPipeline on W with the same batch and token
               budget, then one stream; runs from .venv-openvino (`make openvino-env`)
  prefix       32 requests sharing one ~200-token system prompt, prefix caching on vs off
  single       one stream: W's first --single-requests prompts one after another (the next
               sent when the last finished), this engine with and without its kernels, then
               transformers `generate`
Slow baselines can run on a subset with --baseline-requests (their tok/s is per their own run).
Prints a JSON report, a markdown table and the machine's facts.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

if __name__ == "__main__":  # torch on Intel's OpenMP, as in the worker (worker/model/openmp.py)
    from worker.model.openmp import restart_with_intel_openmp
    restart_with_intel_openmp([sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]])

import torch

from benchmarks import openvino_peer
from benchmarks.matmul_ref import gemm_limit, run_matmul_ref
from benchmarks.report import machine, print_machine, print_table
from shared.messages import RequestPayload
from shared.model_paths import prepare_model, weights_dir
from shared.sampling import SamplingParams
from shared.settings import WorkerSettings
from shared.tokenizer import Tokenizer
from worker.engine.batcher import Batcher
from worker.engine.block_manager import BlockManager
from worker.engine.core import Engine
from worker.model import kernels
from worker.model.model_runner import PagedRunner
from worker.model.model_loader import load_model, load_weights, pick_dtype

SYSTEM = ("You are a careful, friendly assistant for a public library. Answer in plain words, keep answers short, "
          "cite no sources you cannot name, and when a question is about opening hours, membership, borrowing "
          "limits, late fees, room bookings, printing, or events, say that the front desk has the current details. "
          "Never invent a policy. If a question is unclear, ask one short question back. Be kind to children and "
          "patient with everyone. Do not give medical, legal or financial advice; suggest a professional instead. ")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def summarise(name: str, starts: float | list[float], token_times: list[list[float]],
              extra: dict | None = None) -> dict:
    """tok/s over the whole run (from the first start); TTFT from each request's own start."""
    if isinstance(starts, float):
        starts = [starts] * len(token_times)
    start = min(starts)
    end = max(t[-1] for t in token_times)
    tokens = sum(len(t) for t in token_times)
    ttft = [t[0] - s for s, t in zip(starts, token_times)]
    itl = [b - a for t in token_times for a, b in zip(t, t[1:])]
    return {"mode": name, "requests": len(token_times), "output_tokens": tokens, "wall_s": round(end - start, 2),
            "tok_per_s": round(tokens / (end - start), 1), "ttft_p50_s": round(percentile(ttft, 0.5), 3),
            "itl_p50_ms": round(1000 * percentile(itl, 0.5), 1), "itl_p99_ms": round(1000 * percentile(itl, 0.99), 1),
            **(extra or {})}


def run_streamq(model, tok, prompts, new_tokens, batch, budget, blocks=4096, block_size=16, prefix_caching=True,
                name="streamq", sequential=False, use_kernels=True) -> dict:
    """All prompts at once, or one after another (each sent when the last finished)."""
    runner = PagedRunner(model, torch.device("cpu"), blocks, block_size, kernels.load() if use_kernels else None)
    engine = Engine(runner, tok, Batcher(BlockManager(blocks, block_size, prefix_caching), batch, budget))
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    starts: list[float] = []
    times: dict[str, list[float]] = {}
    for group in ([[p] for p in prompts] if sequential else [prompts]):
        starts += [time.perf_counter()] * len(group)
        for p in group:
            seq = engine.add(RequestPayload(id=f"r{len(times)}", model="m", prompt_token_ids=p, params=params))
            times[seq.id] = []
        while engine.has_work():
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                if out.token is not None:
                    times[out.request_id].append(now)
    hits = engine.batcher.blocks.prefix_hits
    return summarise(name, starts, list(times.values()), {"prefix_hit_blocks": hits})


def run_seed(model, prompts, new_tokens, pad_id) -> dict:
    """Static batches of 4; every step runs the whole (left-padded) sequence again, use_cache=False."""
    start = time.perf_counter()
    all_times = []
    with torch.inference_mode():
        for b in range(0, len(prompts), 4):
            group = [list(p) for p in prompts[b:b + 4]]
            times = [[] for _ in group]
            for _ in range(new_tokens):
                width = max(len(p) for p in group)
                ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in group])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
                logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, -1]
                now = time.perf_counter()
                for row, token in enumerate(logits.argmax(-1).tolist()):
                    group[row].append(token)
                    times[row].append(now)
            all_times += times
    return summarise("seed", start, all_times)


class _Clock:
    """A transformers streamer that only notes when each new token arrives."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt = True

    def put(self, value):
        if self._prompt:
            self._prompt = False
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


def run_hf_generate(model, prompts, new_tokens, name="hf-generate") -> dict:
    starts, all_times = [], []
    with torch.inference_mode():
        for p in prompts:
            starts.append(time.perf_counter())
            clock = _Clock()
            model.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           streamer=clock)
            all_times.append(clock.times)
    return summarise(name, starts, all_times)


def run_hf_batch(model, prompts, new_tokens) -> dict:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=model.generation_config.eos_token_id, pad_token_id=0)
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=[list(p) for p in prompts], generation_config=config,
                                   record_timestamps=True, warmup=False)
    times = [list(o.timestamps or []) for o in outputs.values()]
    if not all(times):
        raise RuntimeError("generate_batch gave no timestamps")
    return summarise("hf-batch", start, times)


def run_openvino(settings, prompts, new_tokens, single_requests, dtype, threads, batch, budget,
                 kv_like_model=False, weights="fp32") -> list[dict]:
    """W, then one stream, through OpenVINO GenAI's continuous batching (a child process). Its KV
    cache is u8 by default on CPU; kv_like_model keeps it in the run's dtype, as streamq does.
    `weights`: the IR's weight format (fp32, or NNCF's int8 or int4)."""
    source = weights_dir(settings)
    ir = openvino_peer.export(source, settings.model_cache_dir / f"{source.name}-openvino-{weights}", weights)
    name = "openvino" if weights == "fp32" else f"openvino-{weights}"
    runs = [{"name": name, "prompts": prompts, "new_tokens": new_tokens, "sequential": False},
            {"name": f"single-{name}", "prompts": prompts[:single_requests], "new_tokens": new_tokens,
             "sequential": True}]
    kv = openvino_peer.PRECISION[dtype] if kv_like_model else None
    out = openvino_peer.run(ir, runs, dtype, threads, batch, budget, cache_gb=4,
                            properties={"KV_CACHE_PRECISION": kv} if kv else None)
    extra = {"load_s": out["load_s"], "openvino_genai": out["openvino_genai"], "kv_cache": kv or "u8 (default)"}
    suffix = f" (KV {kv})" if kv else ""
    return [summarise(r["name"] + suffix, r["starts"], r["times"], extra) for r in out["results"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default=str(pick_dtype("auto", torch.device("cpu"))).removeprefix("torch."),
                        choices=["float32", "bfloat16"], help="default: what dtype=auto picks on this CPU")
    parser.add_argument("--modes", default="matmul-ref,streamq,streamq-eager,openvino,hf-batch,hf-generate,seed,prefix,single")
    parser.add_argument("--baseline-requests", type=int, default=32,
                        help="requests for hf-generate and seed (they are slow; W is 32)")
    parser.add_argument("--single-requests", type=int, default=4, help="requests of the one-stream runs")
    parser.add_argument("--openvino-kv-like-model", action="store_true",
                        help="OpenVINO's KV cache in the run's dtype (like streamq's) instead of its default u8")
    parser.add_argument("--openvino-weights", default="fp32", choices=sorted(openvino_peer.WEIGHT_FORMATS),
                        help="the OpenVINO IR's weights: fp32, or compressed by NNCF to int8 or int4 (groups of 32)")
    parser.add_argument("--weights", default="float", choices=["float", "as-served"],
                        help="this engine's weights: the model's float folder in --dtype, or as the worker loads "
                             "them (a GGUF's blocks kept quantized, STREAMQ_QUANTIZATION); with it run only "
                             "the streamq, single and openvino modes")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()

    torch.manual_seed(0)
    settings = WorkerSettings()
    tok = Tokenizer(prepare_model(settings))
    if args.weights == "as-served":
        model = load_weights(settings, torch.device("cpu"), getattr(torch, args.dtype))
    else:
        model = load_model(weights_dir(settings), torch.device("cpu"), getattr(torch, args.dtype))
    workload = json.loads((ROOT / "benchmarks" / "workload_w.json").read_text())
    prompts = [tok.encode_chat(m) for m in workload["messages"]]
    new_tokens = workload["max_tokens"]
    batch, budget = args.batch_size, args.max_num_batched_tokens
    threads = torch.get_num_threads()
    report = {"machine": machine(args.dtype, threads), "prompt_tokens": sum(map(len, prompts)), "results": []}
    print(f"# W: {len(prompts)} prompts, {report['prompt_tokens']} prompt tokens, {new_tokens} new tokens each, "
          f"{args.dtype}, {threads} threads", file=sys.stderr)
    few, one = prompts[:args.baseline_requests], prompts[:args.single_requests]
    for mode in args.modes.split(","):
        print(f"# running {mode}", file=sys.stderr)
        if mode in ("streamq", "streamq-eager"):
            compiled = mode == "streamq"
            run_streamq(model, tok, prompts[:4], 4, batch, budget, use_kernels=compiled)  # warm-up
            results = [run_streamq(model, tok, prompts, new_tokens, batch, budget, name=mode, use_kernels=compiled)]
        elif mode == "seed":
            results = [run_seed(model, few, new_tokens, pad_id=0)]
        elif mode == "hf-generate":
            results = [run_hf_generate(model, few, new_tokens)]
        elif mode == "hf-batch":
            results = [run_hf_batch(model, prompts, new_tokens)]
        elif mode == "matmul-ref":
            results = [run_matmul_ref(model, prompts, new_tokens), gemm_limit(model, prompts, new_tokens)]
        elif mode == "openvino":
            results = run_openvino(settings, prompts, new_tokens, args.single_requests, args.dtype, threads, batch,
                                   budget, args.openvino_kv_like_model, args.openvino_weights)
        elif mode == "single":  # one stream: this engine with and without its kernels, then transformers generate
            run_streamq(model, tok, prompts[:1], 2, 1, budget)  # warm-up
            results = [run_streamq(model, tok, one, new_tokens, batch, budget, name="single-streamq", sequential=True),
                       run_streamq(model, tok, one, new_tokens, batch, budget, name="single-streamq-eager",
                                   sequential=True, use_kernels=False)]
            if args.weights == "float":  # transformers' forward has no quantized weights to run on
                results.append(run_hf_generate(model, one, new_tokens, name="single-hf-generate"))
        elif mode == "prefix":
            shared = [tok.encode_chat([{"role": "system", "content": SYSTEM}] + m) for m in workload["messages"]]
            results = [run_streamq(model, tok, shared, 2, batch, budget, prefix_caching=caching,
                                   name=f"prefix-cache-{'on' if caching else 'off'}") for caching in (True, False)]
        else:
            raise SystemExit(f"unknown mode {mode}")
        for r in results:
            report["results"].append(r)
            print(json.dumps(r), file=sys.stderr)
    ref = next((r["tok_per_s"] for r in report["results"] if r["mode"] == "matmul-ref"), None)
    limit = next((r["tok_per_s"] for r in report["results"] if r["mode"] == "gemm-peak-limit"), None)
    print(json.dumps(report, indent=1))
    print()
    print_table(["mode", "requests", "tok/s", "vs matmul-ref", "vs GEMM-peak limit", "TTFT p50 s", "ITL p50 ms",
                 "ITL p99 ms"],
                [(r["mode"], r["requests"], r["tok_per_s"], f"{r['tok_per_s'] / ref:.2f}" if ref else "-",
                  f"{r['tok_per_s'] / limit:.2f}" if limit else "-", r.get("ttft_p50_s", "-"),
                  r.get("itl_p50_ms", "-"), r.get("itl_p99_ms", "-"))
                 for r in report["results"]])
    gemm = next((r for r in report["results"] if r["mode"] == "gemm-peak-limit"), None)
    extra = {"GEMM rate": f"{gemm['gemm_gflops_per_s']} GFLOP/s", "W": f"{gemm['w_gflop']} GFLOP"} if gemm else {}
    print_machine({**report["machine"], **extra})


if __name__ == "__main__":
    main()
