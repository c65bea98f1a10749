"""The benchmarks' pure helpers: the CPU list vLLM binds to, the flags a report keeps, W's FLOPs,
the cluster benchmark's medians, the load sweep's spread over rounds."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.backends import cpu_ranges
from benchmarks.cluster_capacity import MEDIANS, _row, median_of, pct
from benchmarks.load_sweep import best_rate_ratios, spread
from benchmarks.matmul_ref import w_flops
from benchmarks.report import RELEVANT_FLAGS


def test_cpu_ranges_compress_runs():
    assert cpu_ranges([0, 1]) == "0-1"
    assert cpu_ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert cpu_ranges([3]) == "3"


def test_report_keeps_only_vector_and_matrix_flags():
    flags = "fpu sse4_2 avx avx2 avx512f avx512_bf16 amx_tile amx_bf16 fma".split()
    assert [f for f in flags if RELEVANT_FLAGS.match(f)] == ["avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"]


def test_w_flops_counts_every_fed_token_and_one_head_row_per_output():
    config = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    body = 2 * (16 * 16 + 16 * 8 + 16 * 8 + 16 * 16 + 3 * 16 * 32)  # q, k, v, o, gate/up/down per layer
    work = w_flops(model, [[1, 2, 3], [4, 5]], new_tokens=4)
    assert work["body_params"] == body and work["head_params"] == 50 * 16
    assert work["body_rows"] == 5 + 2 * 3  # the prompts, then 3 fed-back tokens each
    assert work["head_rows"] == 8
    assert work["flops"] == 2 * body * 11 + 2 * 50 * 16 * 8


def test_cluster_capacity_takes_medians_per_setup_and_node():
    def one(setup: str, value: float, nodes: list[float]) -> dict:
        return {"setup": setup, **dict.fromkeys(MEDIANS, value),
                "nodes": [{"commands_per_s": n, "cpu_pct": n / 1000} for n in nodes]}
    rounds = [one("single", 1, [9000]), one("cluster", 5, [1000, 2000, 3000]), one("single", 3, [11000]),
              one("cluster", 7, [3000, 2000, 1000]), one("single", 2, [10000])]
    single, cluster = median_of(rounds, "single"), median_of(rounds, "cluster")
    assert single["events_per_s"] == 2 and single["nodes"] == [{"commands_per_s": 10000, "cpu_pct": 10}]
    assert cluster["gap_p99_s"] == 6 and [n["commands_per_s"] for n in cluster["nodes"]] == [2000, 2000, 2000]
    assert _row(cluster)[-1] == "2.0k, 2 % / 2.0k, 2 % / 2.0k, 2 %"
    assert pct([3, 1, 2, 4], 0.5) == 2 and pct(list(range(101)), 0.99) == 99


def _sweep(goodputs: list[float], tpots: list[float]) -> list[dict]:
    return [{"rate": rate, "goodput": {"requests_per_s": g}, "tpot_ms": {"p50": t}}
            for rate, g, t in zip([1.0, 2.0], goodputs, tpots, strict=True)]


def test_load_sweep_spread_takes_each_rounds_ratio_then_the_median():
    rounds = {"ours": [_sweep([1.0, 2.0], [10, 20]), _sweep([1.0, 1.5], [12, 30]), _sweep([0.9, 1.8], [11, 25])],
              "peer": [_sweep([1.0, 1.0], [20, 40]), _sweep([0.5, 1.5], [12, 15]), _sweep([1.0, 2.0], [11, 50])]}
    rows = spread(rounds, lambda r: r["goodput"]["requests_per_s"])
    assert [row["rate"] for row in rows] == [1.0, 2.0]
    assert rows[0]["ours"] == [1.0, 1.0, 0.9] and rows[0]["peer"] == [1.0, 0.5, 1.0]
    assert rows[0]["ratios"] == [1.0, 2.0, 0.9] and rows[0]["median_ratio"] == 1.0
    assert rows[1]["ratios"] == [2.0, 1.0, 0.9] and rows[1]["median_ratio"] == 1.0
    tpot = spread(rounds, lambda r: r["tpot_ms"]["p50"])
    assert tpot[1]["ratios"] == [0.5, 2.0, 0.5] and tpot[1]["median_ratio"] == 0.5
    # the best rate of each server in each round: 2.0/1.0, 1.5/1.5, 1.8/2.0
    assert best_rate_ratios(rounds) == [2.0, 1.0, 0.9]


def test_load_sweep_spread_marks_a_peer_that_met_no_target():
    rounds = {"ours": [_sweep([1.0, 2.0], [10, 20])], "peer": [_sweep([0.0, 1.0], [20, 40])]}
    assert spread(rounds, lambda r: r["goodput"]["requests_per_s"])[0]["ratios"] == [float("inf")]
