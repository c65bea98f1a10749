"""The benchmarks' pure helpers: the CPU list vLLM binds to, the flags a report keeps, W's FLOPs,
the cluster benchmark's medians."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.backends import cpu_ranges
from benchmarks.cluster_capacity import MEDIANS, _row, median_of, pct
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
