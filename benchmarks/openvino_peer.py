"""OpenVINO GenAI's continuous-batching pipeline as a peer of the engine benchmark.

It lives in its own virtualenv (`make openvino-env`: .venv-openvino), so the benchmark, which
runs in .venv, starts this file with that venv's Python: the parent half (`export`, `run`)
uses only the standard library, and the child half (`main`) imports only openvino.

The model is the converted default model exported once with optimum-cli into the model cache, its
weights in fp32, or compressed by NNCF to int8 or int4 (`--weight-format int8|int4`; int4 in groups
of 32, every layer, like a Q4 GGUF's blocks); the run's dtype becomes OpenVINO's
INFERENCE_PRECISION_HINT (bf16 or f32).
"""
from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-openvino"
PRECISION = {"bfloat16": "bf16", "float32": "f32"}
_request_ids = itertools.count()  # the pipeline's request ids, unique over its life


# optimum-cli's arguments for each weight format: int4 in groups of 32 on every layer (its default
# is groups of 128 and some layers kept in int8), as close as it goes to a GGUF's Q4 blocks.
WEIGHT_FORMATS = {"fp32": ["--weight-format", "fp32"], "int8": ["--weight-format", "int8"],
                  "int4": ["--weight-format", "int4", "--group-size", "32", "--ratio", "1.0"]}


def export(model_dir: Path, out: Path, weights: str = "fp32") -> Path:
    """`out`, exporting the transformers model in `model_dir` to OpenVINO IR there if not done yet,
    its weights in `weights` (WEIGHT_FORMATS)."""
    if (out / "openvino_model.xml").is_file():
        return out
    cli = VENV / "bin" / "optimum-cli"
    if not cli.is_file():
        raise SystemExit(f"{cli} is missing: run `make openvino-env` first")
    print(f"# exporting {model_dir} to {out} (once)", file=sys.stderr)
    subprocess.run([str(cli), "export", "openvino", "--task", "text-generation-with-past", *WEIGHT_FORMATS[weights],
                    "-m", str(model_dir), str(out)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def run(ir_dir: Path, runs: list[dict], dtype: str, threads: int, batch: int, budget: int, cache_gb: int,
        properties: dict | None = None) -> dict:
    """Each of `runs` ({name, prompts (token ids), new_tokens, sequential}) through one pipeline, in
    a child process; returns {"load_s", "results": [{name, starts, times}]}, seconds from its start.
    `properties` are more CPU plugin settings (e.g. KV_CACHE_PRECISION; its default on CPU is u8)."""
    spec = {"model": str(ir_dir), "precision": PRECISION[dtype], "threads": threads, "batch": batch,
            "budget": budget, "cache_gb": cache_gb, "runs": runs, "properties": properties or {}}
    proc = subprocess.run([str(VENV / "bin" / "python"), __file__], input=json.dumps(spec), capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"the OpenVINO run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def _generate(pipe, ov, genai, np, prompts: list[list[int]], new_tokens: int, start: float) -> tuple[list, list]:
    """Add `prompts` at once, step until all finish; each request's token arrival times."""
    config = genai.GenerationConfig()
    config.max_new_tokens = config.min_new_tokens = new_tokens
    config.ignore_eos, config.do_sample = True, False
    starts, times = [time.perf_counter() - start] * len(prompts), [[] for _ in prompts]
    handles = [pipe.add_request(next(_request_ids), ov.Tensor(np.array([p], dtype=np.int64)), config) for p in prompts]
    while pipe.has_non_finished_requests():
        pipe.step()
        now = time.perf_counter() - start
        for row, handle in enumerate(handles):
            if handle.can_read():
                for out in handle.read().values():
                    times[row] += [now] * len(out.generated_ids)
    return starts, times


def main() -> None:
    import numpy as np  # the child half, in .venv-openvino
    import openvino as ov
    import openvino_genai as genai

    spec = json.loads(sys.stdin.read())
    scheduler = genai.SchedulerConfig()
    scheduler.max_num_seqs, scheduler.max_num_batched_tokens = spec["batch"], spec["budget"]
    scheduler.cache_size, scheduler.enable_prefix_caching = spec["cache_gb"], True
    t0 = time.perf_counter()
    pipe = genai.ContinuousBatchingPipeline(spec["model"], scheduler, "CPU", {
        "INFERENCE_PRECISION_HINT": spec["precision"], "INFERENCE_NUM_THREADS": spec["threads"],
        **spec.get("properties", {})})
    load_s = time.perf_counter() - t0
    warm = spec["runs"][0]["prompts"][:4]
    _generate(pipe, ov, genai, np, warm, 4, time.perf_counter())
    results = []
    for r in spec["runs"]:
        start = time.perf_counter()
        groups = [[p] for p in r["prompts"]] if r["sequential"] else [r["prompts"]]
        starts, times = [], []
        for group in groups:  # one at a time when sequential: the next starts after the last finished
            s, t = _generate(pipe, ov, genai, np, group, r["new_tokens"], start)
            starts += s
            times += t
        results.append({"name": r["name"], "starts": starts, "times": times})
    print(json.dumps({"load_s": round(load_s, 2), "openvino_genai": genai.__version__, "results": results}))


if __name__ == "__main__":
    main()
