"""Architectures' variants on the paged engine, token for token against transformers in fp32:
Llama 3.x rope scaling (the runner takes cos/sin from the model's own rotary module), Mistral
with a sliding window (served within the window, where its attention sees every key), and
Phi-3 (fused qkv_proj and gate_up_proj modules; compressed to int8 in test_quant_model.py)."""
from __future__ import annotations

import json

import torch

from tests.tiny_models import build_model
from tests.unit.test_engine import _check, make_engine, prompts, run

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    folder = build_model(tmp_path / "llama3", "llama")
    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"] = {**LLAMA3_ROPE, "rope_theta": config.get("rope_theta", 10000.0)}
    (folder / "config.json").write_text(json.dumps(config))
    engine = make_engine(folder, budget=16)
    rotary = engine.runner.model.model.rotary_emb
    plain = 1.0 / (10000.0 ** (torch.arange(0, rotary.inv_freq.numel() * 2, 2, dtype=torch.float32)
                                / (rotary.inv_freq.numel() * 2)))
    assert not torch.allclose(rotary.inv_freq, plain)  # the scaling is in effect
    seqs = run(engine, prompts(8, seed=4), arrive_every=2)
    assert max(len(s.prompt_ids) + len(s.output_ids) for s in seqs) > LLAMA3_ROPE["original_max_position_embeddings"]
    _check(folder, seqs)


def test_mistral_is_served_within_its_sliding_window(tmp_path):
    from shared.tokenizer import Tokenizer

    folder = build_model(tmp_path / "mistral", "mistral")
    assert Tokenizer(folder).context_length == 48  # what the api checks prompts against
    engine = make_engine(folder, budget=16)
    assert engine.runner.context_length == 48
    fitting = [t for t in prompts(16, seed=2) if len(engine.tokenizer.encode(t)) < 40][:6]  # as the api admits
    seqs = run(engine, fitting, arrive_every=2)
    assert len(seqs) >= 3 and all(len(s.prompt_ids) + len(s.output_ids) <= 48 for s in seqs)
    assert any(len(s.prompt_ids) + len(s.output_ids) == 48 for s in seqs)  # some ran to the window's end
    _check(folder, [s for s in seqs if len(s.output_ids) == 16])  # those transformers' generate also ends there


def test_phi3_runs_on_the_fused_layers_and_matches_transformers(tmp_path):
    folder = build_model(tmp_path / "phi3", "phi3")
    engine = make_engine(folder, budget=16)
    assert engine.runner.fused is not None  # the paged engine, not the static one
    seqs = run(engine, prompts(6, seed=5), arrive_every=2)
    _check(folder, seqs)



def test_phi3_with_a_partial_rotary_dimension_is_left_to_the_static_engine(tmp_path):
    from transformers import AutoModelForCausalLM

    from worker.model_runner import supports

    folder = build_model(tmp_path / "phi3", "phi3")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert supports(model)
    model.config.partial_rotary_factor = 0.75  # Phi-4-mini's: rotary on 3/4 of each head, which the kernels do not do
    assert not supports(model)
