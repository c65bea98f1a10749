"""Embeddings and rerank scores of the default model against transformers on the same weights.

    .venv/bin/python benchmarks/embeddings.py                       # bf16 where the CPU has it, and fp32
    .venv/bin/python benchmarks/embeddings.py --inputs 32 --rounds 3
    .venv/bin/python benchmarks/embeddings.py --minilm --inputs 1024   # all-MiniLM-L6-v2 through the stack

With --minilm: all-MiniLM-L6-v2 on a worker of its own behind the api (Redis, real processes)
against SentenceTransformer.encode(batch_size=32) in the same run (minilm_through_the_stack).

The engine (in this process, as a worker runs it) embeds --inputs texts (the chat prompts of
benchmarks/workload_w.json, user turns) as one pooling request, with the weights as served (the
GGUF kept quantized, on this CPU's kernels: what `make run` serves; on AVX-512 VNNI also with the
projections held to fp32 activations, STREAMQ_CPU_ISA=avx512) and as floats (the GGUF dequantized). The reference is transformers' AutoModel in fp32 on the float weights: the mean of
the last hidden states over each input's tokens, scaled to length 1 (api/openai/pooling/inputs.py). Reported
per dtype and weights: the least and median cosine to the reference, and the engine's inputs and
tokens per second (median of --rounds). Rerank: the largest difference of a yes-probability
to transformers' on the same prompts, and how many of 10 hand-written queries
(benchmarks/data/rerank_small.json) get their relevant document ranked first (chance: 2.5). Prints JSON, then a markdown table and the machine line.
"""
from __future__ import annotations

import argparse
import base64
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from api.openai.pooling.inputs import floats, rerank_candidates, rerank_prompt
from benchmarks.report import machine, print_machine, print_table
from shared.messages import PoolSpec, RequestPayload
from shared.model_paths import prepare_model, weights_dir
from shared.sampling import SamplingParams
from shared.settings import WorkerSettings
from shared.tokenizer import Tokenizer
from worker.model import kernels
from worker.engine.batcher import Batcher
from worker.engine.block_manager import BlockManager
from worker.engine.core import Engine
from worker.model.model_loader import load_model, load_weights, pick_dtype
from worker.model.model_runner import PagedRunner

BLOCKS, BLOCK_SIZE, BUDGET = 1024, 16, 512
RERANK_QUERY = "How do I keep a service running when a machine fails?"


def engine_for(model, tok: Tokenizer, isa: str) -> Engine:
    runner = PagedRunner(model, torch.device("cpu"), BLOCKS, BLOCK_SIZE, kernels.with_isa(kernels.load(), isa))
    return Engine(runner, tok, Batcher(BlockManager(BLOCKS, BLOCK_SIZE), 8, BUDGET))


def pool(engine: Engine, inputs: list[list[int]], **spec) -> tuple[np.ndarray, float]:
    """One pooling request of `inputs` through the engine: its results and the seconds it took."""
    payload = RequestPayload(id="p", model="m", prompt_token_ids=[t for ids in inputs for t in ids],
                             params=SamplingParams(max_tokens=1), pool=PoolSpec(lengths=list(map(len, inputs)), **spec))
    start = time.perf_counter()
    engine.add(payload)
    ends = [out.end for _ in iter(engine.has_work, False) for out in engine.step() if out.finished]
    seconds = time.perf_counter() - start
    return np.array([floats(v) for v in ends[0].pooled]), seconds


def top_first(engine: Engine, tok: Tokenizer, labeled: list[dict], yes_no: list[int]) -> int:
    """How many of the labeled queries get their relevant document (the first) ranked first."""
    hits = 0
    for item in labeled:
        prompts = [rerank_prompt(tok, item["query"], doc) for doc in item["documents"]]
        scores, _ = pool(engine, prompts, task="score", candidates=yes_no)
        hits += int(np.argmax(scores[:, 0]) == 0)
    return hits


def reference(folder: Path, inputs: list[list[int]], rerank: list[list[int]], yes_no: list[int]):
    from transformers import AutoModel, AutoModelForCausalLM

    core = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    lm = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        rows = [core(torch.tensor([ids])).last_hidden_state[0].mean(dim=0) for ids in inputs]
        scores = [torch.softmax(lm(torch.tensor([ids])).logits[0, -1, yes_no], dim=0)[0].item() for ids in rerank]
    return torch.nn.functional.normalize(torch.stack(rows), dim=1).numpy(), np.array(scores)


def minilm_through_the_stack(texts: list[str], rounds: int, requests: int, concurrency: int) -> None:
    """all-MiniLM-L6-v2 served by a worker of its own behind the api (Redis, real processes), against
    SentenceTransformer.encode(batch_size=32) in this process in the same numerics, rounds
    alternating: fp32 (STREAMQ_DTYPE=float32), and where the CPU has fast bf16 the default
    (STREAMQ_DTYPE=auto: bf16 matmuls on fp32 weights) against encode under torch.autocast(bf16).
    The texts go as `requests` requests of equal share, `concurrency` at a time, answered in base64
    as the openai client asks; inputs/s of each (median of rounds), and the least cosine of an
    embedding to sentence-transformers' fp32 one."""
    import contextlib
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from sentence_transformers import SentenceTransformer

    from streamq.stack import Stack
    from streamq.testing.tiny_encoders import minilm
    from worker.model.model_loader import pick_dtype

    folder = minilm()
    reference_model = SentenceTransformer(str(folder), device="cpu")
    exact = reference_model.encode(texts, batch_size=32)
    share = -(-len(texts) // requests)
    batches = [texts[i:i + share] for i in range(0, len(texts), share)]
    tokens = sum(len(ids) - 2 for ids in reference_model.tokenizer(texts)["input_ids"])
    numerics = [("float32", "float32", None)]
    if pick_dtype("auto", torch.device("cpu")) == torch.bfloat16:
        numerics.append(("auto", "float32, bfloat16 matmuls", torch.bfloat16))
    rows = []
    for setting, name, autocast in numerics:
        env = {"STREAMQ_MODEL": str(folder), "STREAMQ_SERVED_MODEL_NAME": "minilm", "STREAMQ_DTYPE": setting}
        with tempfile.TemporaryDirectory() as tmp, Stack(Path(tmp), env) as stack:
            url = stack.urls[0]

            def embed(batch: list[str], url: str = url) -> list[np.ndarray]:  # base64, as the openai client asks
                reply = httpx.post(f"{url}/v1/embeddings", json={"model": "minilm", "input": batch,
                                                                "encoding_format": "base64"}, timeout=600)
                reply.raise_for_status()
                return [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in reply.json()["data"]]

            embed(texts[:8])  # warm: the worker's first forward
            ours, theirs = [], []
            with ThreadPoolExecutor(concurrency) as pool_:
                for _ in range(rounds):
                    start = time.perf_counter()
                    with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
                        reference_model.encode(texts, batch_size=32)
                    theirs.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    got = np.array([v for vectors in pool_.map(embed, batches) for v in vectors], dtype=np.float32)
                    ours.append(time.perf_counter() - start)
        cos = (got * exact).sum(axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(exact, axis=1)
        row = {"numerics": name, "texts": len(texts), "tokens": tokens, "requests": len(batches),
               "concurrency": concurrency, "streamq_s": ours, "sentence_transformers_s": theirs,
               "streamq_inputs_per_s": len(texts) / statistics.median(ours),
               "sentence_transformers_inputs_per_s": len(texts) / statistics.median(theirs),
               "least_cosine_to_fp32": float(cos.min())}
        row["ratio"] = row["streamq_inputs_per_s"] / row["sentence_transformers_inputs_per_s"]
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    print(json.dumps(rows, indent=1))
    print()
    print_table(["all-MiniLM-L6-v2", "texts (tokens)", "streamq through the stack, inputs/s",
                 "SentenceTransformer.encode(batch_size=32), inputs/s", "ratio", "least cosine to fp32"],
                [(r["numerics"], f"{len(texts)} ({tokens})",
                  f"{r['streamq_inputs_per_s']:.0f} ({len(batches)} requests, {concurrency} at a time)",
                  f"{r['sentence_transformers_inputs_per_s']:.0f}", f"{r['ratio']:.2f}",
                  f"{r['least_cosine_to_fp32']:.6f}") for r in rows])
    print_machine(machine(", ".join(r["numerics"] for r in rows), torch.get_num_threads(), texts=len(texts),
                          rounds=rounds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="auto,float32", help="comma-separated: auto, float32, bfloat16")
    parser.add_argument("--inputs", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--minilm", action="store_true",
                        help="all-MiniLM-L6-v2 through the stack against sentence-transformers instead")
    parser.add_argument("--requests", type=int, default=16, help="--minilm: the texts split into this many requests")
    parser.add_argument("--concurrency", type=int, default=4, help="--minilm: requests in flight at once")
    args = parser.parse_args()
    if args.minilm:
        data = json.loads((ROOT / "benchmarks" / "workload_w.json").read_text())
        turns = [m["content"] for chat in data["messages"] for m in chat if m["role"] in ("user", "assistant")]
        texts = [" ".join(t.split()[:150]) for t in turns]  # within MiniLM's 256 tokens
        texts = (texts * (1 + args.inputs // len(texts)))[:args.inputs]
        minilm_through_the_stack(texts, args.rounds, args.requests, args.concurrency)
        return

    settings = WorkerSettings(_env_file=None)
    folder = prepare_model(settings)
    tok = Tokenizer(folder)
    data = json.loads((ROOT / "benchmarks" / "workload_w.json").read_text())
    texts = [next(m["content"] for m in reversed(chat) if m["role"] == "user") for chat in data["messages"]]
    texts = (texts * (1 + args.inputs // len(texts)))[:args.inputs]
    inputs = [tok.encode(t) for t in texts]
    rerank = [rerank_prompt(tok, RERANK_QUERY, t) for t in texts[:8]]
    yes_no = rerank_candidates(tok)
    labeled = json.loads((ROOT / "benchmarks" / "data" / "rerank_small.json").read_text())["queries"]
    want, want_scores = reference(weights_dir(settings), inputs, rerank, yes_no)
    report = {"inputs": len(inputs), "tokens": sum(map(len, inputs)), "results": []}
    dtypes = dict.fromkeys(str(pick_dtype(d, torch.device("cpu"))).removeprefix("torch.")
                           for d in args.dtypes.split(","))
    # As served, the quantized projections round activations to int8 where the CPU has AVX-512 VNNI
    # (cpu_isa auto); the widest ISA with fp32 activations is measured beside it.
    fp32_isa = kernels.widest_fp32(kernels.load())
    runs = [("as-served", "auto"), ("float", "auto")]
    if fp32_isa != kernels.load().isas[0]:
        runs.insert(1, ("as-served", fp32_isa))
    for dtype in dtypes:
        for weights, isa in runs:
            model = (load_weights(settings, torch.device("cpu"), getattr(torch, dtype)) if weights == "as-served"
                     else load_model(weights_dir(settings), torch.device("cpu"), getattr(torch, dtype)))
            engine = engine_for(model, tok, isa)
            seconds = []
            for _ in range(args.rounds):
                got, took = pool(engine, inputs, task="embed")
                seconds.append(took)
            scores, _ = pool(engine, rerank, task="score", candidates=yes_no)
            top1 = top_first(engine, tok, labeled, yes_no)
            cos = (got * want).sum(axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
            median_s = statistics.median(seconds)
            row = {"dtype": dtype, "weights": weights, "cpu_isa": isa, "cos_min": float(cos.min()), "cos_median": float(np.median(cos)),
                   "score_max_diff": float(np.abs(scores[:, 0] - want_scores).max()), "rerank_top1": top1,
                   "seconds": seconds,
                   "inputs_per_s": len(inputs) / median_s, "tokens_per_s": report["tokens"] / median_s}
            report["results"].append(row)
            print(json.dumps(row), file=sys.stderr)
    print(json.dumps(report, indent=1))
    print()
    print_table(["dtype", "weights", "cpu_isa", "cosine to transformers fp32: least", "median", "rerank: largest |diff|",
                 f"rerank: relevant first (of {len(labeled)})", "inputs/s", "tokens/s"],
                [(r["dtype"], r["weights"], r["cpu_isa"], f"{r['cos_min']:.6f}", f"{r['cos_median']:.6f}",
                  f"{r['score_max_diff']:.5f}", r["rerank_top1"], f"{r['inputs_per_s']:.1f}", f"{r['tokens_per_s']:.0f}")
                 for r in report["results"]])
    print_machine(machine(", ".join(dtypes), torch.get_num_threads(), inputs=len(inputs), tokens=report["tokens"]))


if __name__ == "__main__":
    main()
