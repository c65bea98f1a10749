"""EleutherAI's lm-evaluation-harness (pinned, in .venv-lmeval: scripts/lmeval-env.sh) against the
running stack with its `local-completions` model, and with its `hf` backend on the same weights in
fp32: three small tasks of our own (tests/e2e/lm_eval_tasks: multiple choice, perplexity,
generate-until) give the same accuracy, perplexity and exact matches."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LMEVAL = ROOT / ".venv-lmeval" / "bin" / "python"
TASKS = Path(__file__).parent / "lm_eval_tasks"
NAMES = ["streamq_mc", "streamq_ppl", "streamq_gen"]
MAX_LENGTH = 128  # both backends' window: a perplexity's rolling windows must match
# lm-eval's hf backend adds the tokenizer's BOS by default and its API models do not: said alike to both
BOS = "add_bos_token=True"

RUN = """
import json, sys
import lm_eval
from lm_eval.tasks import TaskManager
model, args, tasks = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
out = lm_eval.simple_evaluate(model=model, model_args=args, tasks=tasks, device="cpu", batch_size=1,
                              task_manager=TaskManager(include_path="."), random_seed=0, numpy_random_seed=0,
                              torch_random_seed=0, fewshot_random_seed=0, log_samples=True)
samples = {task: [s["filtered_resps"] for s in sorted(rows, key=lambda s: s["doc_id"])]
           for task, rows in out["samples"].items()}
print("RESULTS " + json.dumps({"results": out["results"], "samples": samples}, default=str))
"""


def evaluate(model: str, args: str) -> tuple[dict, dict]:
    """lm-eval's results of the three tasks, and each task's filtered responses, doc by doc."""
    if not LMEVAL.is_file():
        pytest.fail("lm-eval's environment is missing: run scripts/lmeval-env.sh (make test does)")
    done = subprocess.run([str(LMEVAL), "-c", RUN, model, args, ",".join(NAMES)], cwd=TASKS, capture_output=True,
                          text=True, timeout=900, env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                                                       "TOKENIZERS_PARALLELISM": "false", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULTS "))
    out = json.loads(line.removeprefix("RESULTS "))
    return out["results"], out["samples"]


def test_lm_eval_local_completions_equals_its_hf_backend(stack, model, tiny_llama):
    served, served_samples = evaluate("local-completions", f"base_url={stack.urls[0]}/v1/completions,model={model},"
                                           f"tokenizer={tiny_llama},tokenized_requests=True,max_length={MAX_LENGTH},"
                                           f"num_concurrent=1,max_retries=1,{BOS}")
    reference, reference_samples = evaluate("hf", f"pretrained={tiny_llama},dtype=float32,max_length={MAX_LENGTH},{BOS}")
    assert served["streamq_mc"]["acc,none"] == reference["streamq_mc"]["acc,none"]
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert served["streamq_ppl"][metric] == pytest.approx(reference["streamq_ppl"][metric], rel=1e-4)
    assert served["streamq_gen"]["exact_match,none"] == reference["streamq_gen"]["exact_match,none"]
    assert served_samples["streamq_gen"] == reference_samples["streamq_gen"]  # the same greedy text, doc by doc
    for ours, theirs in zip(served_samples["streamq_mc"], reference_samples["streamq_mc"]):  # each choice's
        assert [float(x[0]) for x in ours] == pytest.approx([float(x[0]) for x in theirs], abs=1e-4)  # loglikelihood
        assert [x[1] for x in ours] == [x[1] for x in theirs]  # and whether it is the greedy continuation
