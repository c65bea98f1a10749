"""Architectures' variants on the paged engine, token for token against transformers in fp32:
Llama 3.x rope scaling (the runner takes cos/sin from the model's own rotary module), Mistral
and Gemma 3 with sliding windows (every layer's, or the local layers' only) served past them, and
Phi-3 (fused qkv_proj and gate_up_proj modules; compressed to int8 in test_quant_model.py)."""
from __future__ import annotations

import json

import torch

import pytest

from shared.tokenizer import Tokenizer
from streamq.testing.tiny_models import build_model
from tests.unit.test_engine import _check, make_engine, prompts, run
from worker.model import kernels
from worker.engine.batcher import Batcher
from worker.engine.block_manager import BlockManager
from worker.engine.core import Engine
from worker.model.model_loader import load_model
from worker.model.model_runner import PagedRunner

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


def _windowed_engine(folder, kernels_on: bool) -> Engine:
    model = load_model(folder, torch.device("cpu"), torch.float32)
    runner = PagedRunner(model, torch.device("cpu"), 256, 4, kernels.load() if kernels_on else None)
    return Engine(runner, Tokenizer(folder), Batcher(BlockManager(256, 4, True), 8, 16))


@pytest.mark.parametrize("kernels_on", [True, False], ids=["kernels", "portable"])
@pytest.mark.parametrize("kind", ["mistral", "gemma3"])
def test_sliding_window_layers_match_transformers_past_the_window(tmp_path, kind, kernels_on):
    """Mistral windows every layer, Gemma 3 its local layers only (each with its own rotary base);
    the tiny models' window is 13 positions, so most prompts and every output run past it, in
    prefill chunks of up to 16 and in decodes, on the step kernels and on the portable path."""
    folder = build_model(tmp_path / kind, kind)
    assert Tokenizer(folder).context_length == 256  # the whole context is served, not just the window
    engine = _windowed_engine(folder, kernels_on)
    assert engine.runner.windows == ([13, 13] if kind == "mistral" else [13, 0, 13])
    assert (engine.runner.kernels is not None) == kernels_on
    texts = prompts(8, seed=2)
    seqs = run(engine, texts, arrive_every=2)
    assert sum(len(s.prompt_ids) > 13 for s in seqs) >= 4
    _check(folder, seqs)
    unwindowed = _windowed_engine(folder, kernels_on)  # the same engine attending to every key
    unwindowed.runner.windows = [0] * len(unwindowed.runner.windows)
    unwindowed.runner.window = 0
    if unwindowed.runner.one_token is not None:
        unwindowed.runner.one_token = unwindowed.runner._one_token_layers()
    assert [s.output_ids for s in run(unwindowed, texts, arrive_every=2)] != [s.output_ids for s in seqs]


def test_gemma3_runs_on_the_paged_engine(tmp_path):
    from transformers import AutoModelForCausalLM

    from worker.model.forward_plan import supports

    folder = build_model(tmp_path / "gemma3", "gemma3")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert supports(model)
    model.config.attn_logit_softcapping = 50.0  # Gemma 2's softcapped scores: not done by the paged engine
    assert not supports(model)


def test_phi3_runs_on_the_fused_layers_and_matches_transformers(tmp_path):
    folder = build_model(tmp_path / "phi3", "phi3")
    engine = make_engine(folder, budget=16)
    assert engine.runner.fused is not None  # the paged engine, not the static one
    seqs = run(engine, prompts(6, seed=5), arrive_every=2)
    _check(folder, seqs)



def test_phi3_with_a_partial_rotary_dimension_is_left_to_the_static_engine(tmp_path):
    from transformers import AutoModelForCausalLM

    from worker.model.forward_plan import supports

    folder = build_model(tmp_path / "phi3", "phi3")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert supports(model)
    model.config.partial_rotary_factor = 0.75  # Phi-4-mini's: rotary on 3/4 of each head, which the kernels do not do
    assert not supports(model)


def test_each_layers_window_is_the_one_transformers_applies():
    from transformers import MistralConfig, Qwen2Config

    from worker.model.kv_cache import layer_windows

    assert layer_windows(Qwen2Config(num_hidden_layers=3)) == [0, 0, 0]  # use_sliding_window off
    qwen = Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert layer_windows(qwen) == [0, 8, 8]  # from max_window_layers on, as its layer_types say
    assert layer_windows(MistralConfig(num_hidden_layers=2, sliding_window=None)) == [0, 0]
    assert layer_windows(MistralConfig(num_hidden_layers=2, sliding_window=4096)) == [4096, 4096]
