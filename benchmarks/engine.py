"""Engine benchmark: workload W through this engine and the baselines, in ONE process run.

    .venv/bin/python benchmarks/engine.py --dtype float32
    .venv/bin/python benchmarks/engine.py --dtype float32 --modes streamq,ceiling,prefix

Workload W (benchmarks/workload_w.json): 32 chat-templated prompts sent at once, 64 new tokens
each, greedy, ignore_eos, on the default model. Modes:
  streamq      this engine (continuous batching, paged KV cache), in-process
  seed         the seed tutorial's design: static batches of 4, no KV cache (the whole sequence
               is recomputed every step)
  hf-generate  transformers `generate`, one request at a time
  hf-batch     transformers' own continuous batching (`generate_batch`)
  ceiling      the model's matmuls alone (every layer's weights and the lm_head, so each decode
               step streams all the weights as the real model does), W's prefill + 64 steps at batch 32
  prefix       32 requests sharing one ~200-token system prompt, prefix caching on vs off
  single       one request alone: this engine, then transformers `generate`
Slow baselines can run on a subset with --baseline-requests (their tok/s is per their own run).
Prints a JSON report and a markdown table.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.report import print_table  # noqa: E402
from shared.messages import RequestPayload  # noqa: E402
from shared.models import prepare_model, weights_dir  # noqa: E402
from shared.sampling import SamplingParams  # noqa: E402
from shared.settings import WorkerSettings  # noqa: E402
from shared.tokenizer import Tokenizer  # noqa: E402
from worker.batcher import Batcher  # noqa: E402
from worker.block_manager import BlockManager  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.model_runner import PagedRunner  # noqa: E402
from worker.runner import load_model  # noqa: E402

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


def summarise(name: str, start: float, token_times: list[list[float]], extra: dict | None = None) -> dict:
    end = max(t[-1] for t in token_times)
    tokens = sum(len(t) for t in token_times)
    ttft = [t[0] - start for t in token_times]
    itl = [b - a for t in token_times for a, b in zip(t, t[1:])]
    return {"mode": name, "requests": len(token_times), "output_tokens": tokens, "wall_s": round(end - start, 2),
            "tok_per_s": round(tokens / (end - start), 1), "ttft_p50_s": round(percentile(ttft, 0.5), 3),
            "itl_p50_ms": round(1000 * percentile(itl, 0.5), 1), "itl_p99_ms": round(1000 * percentile(itl, 0.99), 1),
            **(extra or {})}


def run_streamq(model, tok, prompts, new_tokens, batch, budget, blocks=4096, block_size=16, prefix_caching=True,
                name="streamq") -> dict:
    runner = PagedRunner(model, torch.device("cpu"), blocks, block_size)
    engine = Engine(runner, tok, Batcher(BlockManager(blocks, block_size, prefix_caching), batch, budget))
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    seqs = [engine.add(RequestPayload(id=f"r{i}", model="m", prompt_token_ids=p, params=params), "0-0")
            for i, p in enumerate(prompts)]
    times: dict[str, list[float]] = {s.id: [] for s in seqs}
    while engine.has_work():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.token is not None:
                times[out.seq.id].append(now)
    hits = engine.batcher.blocks.prefix_hits
    return summarise(name, start, list(times.values()), {"prefix_hit_blocks": hits})


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


def run_hf_generate(model, prompts, new_tokens) -> dict:
    start = time.perf_counter()
    all_times = []
    with torch.inference_mode():
        for p in prompts:
            clock = _Clock()
            model.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           streamer=clock)
            all_times.append(clock.times)
    return summarise("hf-generate", start, all_times)


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


def run_ceiling(model, prompts, new_tokens) -> dict:
    """The matmuls of the real weights alone: W's prefill, then decode steps at the full batch."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.lm_head]
    head = model.lm_head.weight
    hidden = model.config.hidden_size
    dtype = head.dtype
    total_prompt = sum(len(p) for p in prompts)
    batch = len(prompts)

    inputs: dict[tuple[int, int], torch.Tensor] = {}

    def rows_of(rows: int, width: int) -> torch.Tensor:
        if (rows, width) not in inputs:
            inputs[(rows, width)] = torch.randn(rows, width, dtype=dtype)
        return inputs[(rows, width)]

    def step(rows: int, head_rows: int) -> None:
        for w in weights:  # every projection of every layer, each with its own weights
            torch.mm(rows_of(rows, w.shape[1]), w.t())
        torch.mm(rows_of(head_rows, hidden), head.t())

    with torch.inference_mode():
        step(batch, batch)  # warm-up
        t0 = time.perf_counter()
        step(total_prompt, batch)
        prefill = time.perf_counter() - t0
        t1 = time.perf_counter()
        for _ in range(new_tokens):
            step(batch, batch)
        decode = time.perf_counter() - t1
    wall = prefill + decode
    return {"mode": "ceiling", "requests": batch, "output_tokens": batch * new_tokens, "wall_s": round(wall, 2),
            "tok_per_s": round(batch * new_tokens / wall, 1), "prefill_s": round(prefill, 3),
            "decode_step_ms": round(1000 * decode / new_tokens, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--modes", default="ceiling,streamq,hf-batch,hf-generate,seed,prefix,single")
    parser.add_argument("--baseline-requests", type=int, default=32,
                        help="requests for hf-generate and seed (they are slow; W is 32)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()

    torch.manual_seed(0)
    settings = WorkerSettings()
    tok = Tokenizer(prepare_model(settings))
    model = load_model(weights_dir(settings), torch.device("cpu"), getattr(torch, args.dtype))
    workload = json.loads((ROOT / "benchmarks" / "workload_w.json").read_text())
    prompts = [tok.encode_chat(m) for m in workload["messages"]]
    new_tokens = workload["max_tokens"]
    modes = args.modes.split(",")
    report = {"dtype": args.dtype, "threads": torch.get_num_threads(), "prompt_tokens": sum(map(len, prompts)),
              "results": []}
    print(f"# W: {len(prompts)} prompts, {report['prompt_tokens']} prompt tokens, {new_tokens} new tokens each, "
          f"{args.dtype}, {report['threads']} threads", file=sys.stderr)
    few = prompts[:args.baseline_requests]
    for mode in modes:
        print(f"# running {mode}", file=sys.stderr)
        if mode == "streamq":
            run_streamq(model, tok, prompts[:4], 4, args.batch_size, args.max_num_batched_tokens)  # warm-up
            result = run_streamq(model, tok, prompts, new_tokens, args.batch_size, args.max_num_batched_tokens)
        elif mode == "seed":
            result = run_seed(model, few, new_tokens, pad_id=0)
        elif mode == "hf-generate":
            result = run_hf_generate(model, few, new_tokens)
        elif mode == "hf-batch":
            result = run_hf_batch(model, prompts, new_tokens)
        elif mode == "ceiling":
            result = run_ceiling(model, prompts, new_tokens)
        elif mode == "single":  # one stream alone: this engine, then transformers generate
            for r in (run_streamq(model, tok, prompts[:1], new_tokens, 1, args.max_num_batched_tokens,
                                  name="single-streamq"),
                      {**run_hf_generate(model, prompts[:1], new_tokens), "mode": "single-hf-generate"}):
                report["results"].append(r)
                print(json.dumps(r), file=sys.stderr)
            continue
        elif mode == "prefix":
            shared = [tok.encode_chat([{"role": "system", "content": SYSTEM}] + m) for m in workload["messages"]]
            for caching in (True, False):
                r = run_streamq(model, tok, shared, 2, args.batch_size, args.max_num_batched_tokens,
                                prefix_caching=caching, name=f"prefix-cache-{'on' if caching else 'off'}")
                report["results"].append(r)
                print(json.dumps(r), file=sys.stderr)
            continue
        else:
            raise SystemExit(f"unknown mode {mode}")
        report["results"].append(result)
        print(json.dumps(result), file=sys.stderr)
    ceiling = next((r["tok_per_s"] for r in report["results"] if r["mode"] == "ceiling"), None)
    print(json.dumps(report, indent=1))
    print()
    print_table(["mode", "requests", "tok/s", "vs ceiling", "TTFT p50 s", "ITL p50 ms", "ITL p99 ms"],
                [(r["mode"], r["requests"], r["tok_per_s"], f"{r['tok_per_s'] / ceiling:.2f}" if ceiling else "-",
                  r.get("ttft_p50_s", "-"), r.get("itl_p50_ms", "-"), r.get("itl_p99_ms", "-"))
                 for r in report["results"]])


if __name__ == "__main__":
    main()
