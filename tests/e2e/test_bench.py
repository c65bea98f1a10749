"""`streamq bench` against a live stack: it runs, and its numbers add up."""
import json
import subprocess
import sys

import pytest

from tests.stack import ROOT


def bench(stack, tmp_path, *args):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "streamq.cli", "bench", "--url", stack.urls[0], "--quiet",
                           "--model", stack.model_name, "--json", str(out), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.parametrize("endpoint", ["native", "openai-chat", "openai-completions"])
def test_bench_counts_every_token(stack, tmp_path, endpoint):
    data, text = bench(stack, tmp_path, "--endpoint", endpoint, "--num-prompts", "6", "--concurrency", "3",
                       "--max-tokens", "8", "--ignore-eos")
    summary = data["summary"]
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["output_tokens"] == 48  # 6 requests x 8 tokens, as the server counted them
    if endpoint == "native":
        assert summary["received_tokens"] == 48  # one event per token
    else:
        assert 6 <= summary["received_tokens"] <= 48  # chunks with text
    assert len(data["requests"]) == 6 and all(len(r["token_times"]) == r["received_tokens"] for r in data["requests"])
    assert summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p50"]
    assert "TTFT" in text and "output throughput" in text


def test_bench_poisson_rate_and_seed_stream(stack, tmp_path):
    data, _ = bench(stack, tmp_path, "--endpoint", "seed-stream", "--num-prompts", "4", "--request-rate", "20",
                    "--max-tokens", "4")
    assert data["summary"]["completed"] == 4 and data["summary"]["output_tokens"] > 0
    assert data["summary"]["config"]["request_rate"] == 20


def test_bench_bursty_arrivals_and_goodput(stack, tmp_path):
    data, text = bench(stack, tmp_path, "--num-prompts", "4", "--request-rate", "20", "--burstiness", "0.5",
                       "--max-tokens", "4", "--ignore-eos", "--goodput", "e2el:3600000", "ttft:3600000")
    summary = data["summary"]
    assert summary["config"]["burstiness"] == 0.5
    # an hour for each target: every completed request meets it
    assert summary["goodput"]["requests_met"] == summary["completed"] == 4
    assert summary["ttft_ms"]["p50"] <= summary["ttft_ms"]["p90"] <= summary["ttft_ms"]["p99"]
    assert "goodput" in text and "p90" in text and "HTTP Request" not in text


def test_bench_refuses_a_goodput_target_it_does_not_know(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "streamq.cli", "bench", "--url", "http://127.0.0.1:9", "--quiet",
                           "--goodput", "latency:100"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "ttft, tpot, e2el" in proc.stderr


def test_bench_reports_errors_by_kind(stack, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "streamq.cli", "bench", "--url", stack.urls[0], "--quiet",
                           "--endpoint", "openai-chat", "--model", "no-such-model", "--num-prompts", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "http 404" in proc.stdout
