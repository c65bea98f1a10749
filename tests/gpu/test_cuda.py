"""The built-in engine on a CUDA device: the worker picks the GPU and bf16 by itself, its paged KV
cache lives on the GPU, greedy tokens equal transformers' generate on the same GPU in fp32, and
bf16 and seeded sampling run there. Skipped where torch sees no CUDA device (conftest.py)."""
from __future__ import annotations

import random

import pytest
import torch

from shared.messages import RequestPayload
from shared.sampling import SamplingParams
from shared.settings import WorkerSettings
from shared.tokenizer import Tokenizer
from worker.engine.batcher import Batcher
from worker.engine.block_manager import BlockManager
from worker.engine.core import Engine
from worker.main import build_engine
from worker.model.model_runner import PagedRunner
from worker.model.model_loader import load_model, pick_device, pick_dtype

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
WORDS = "once upon a time the capital of France is Paris and Seoul streams batches caches 안녕 😀 🚀".split()
NEW_TOKENS = 16


def texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def make_engine(model: torch.nn.Module, folder, budget: int = 32, graphs: bool = False) -> Engine:
    """Batch 8 and a 32-token budget: longer prompts are prefilled in chunks beside decodes;
    graphs: decode steps replay CUDA graphs (worker/model/cuda_graphs.py)."""
    runner = PagedRunner(model, CUDA, num_blocks=256, block_size=4, graph_batch=8 if graphs else 0)
    return Engine(runner, Tokenizer(folder), Batcher(BlockManager(256, 4, True), 8, budget))


def run(engine: Engine, prompts: list[str], **params) -> list:
    """Submit a prompt every other step, then step to the end."""
    seqs, pending, steps = [], list(enumerate(prompts)), 0
    while pending or engine.has_work():
        if pending and steps % 2 == 0:
            i, text = pending.pop(0)
            p = SamplingParams(**{"temperature": 0, "max_tokens": NEW_TOKENS, **params})
            ids = engine.tokenizer.encode(text)
            seqs.append(engine.add(RequestPayload(id=f"r{i}", model="m", prompt_token_ids=ids, params=p)))
        engine.step()
        steps += 1
    return seqs


@torch.inference_mode()
def generate(model: torch.nn.Module, prompt_ids: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt_ids], device=CUDA), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def test_auto_picks_the_gpu_and_bf16():
    device = pick_device("auto")
    assert device.type == "cuda"
    half = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16  # bf16 from Ampere on
    assert pick_dtype("auto", device) == half


def test_the_worker_builds_its_engine_and_kv_cache_on_the_gpu(tiny_llama, tmp_path):
    settings = WorkerSettings(model=str(tiny_llama), model_cache_dir=tmp_path, device="auto", dtype="auto",
                              batch_size=4, max_num_batched_tokens=64, kv_cache_gb=0.01)
    engine = build_engine(settings)
    runner = engine.runner
    dtype = pick_dtype("auto", CUDA)
    assert runner.device.type == "cuda"
    assert {(p.device.type, p.dtype) for p in runner.model.parameters()} == {("cuda", dtype)}
    for cache in (runner.k_cache, runner.v_cache):
        assert cache.is_cuda and cache.dtype == dtype
    assert runner.graphs is not None and runner.graphs.capture  # STREAMQ_CUDA_GRAPHS is on by default
    [seq] = run(engine, ["Once upon a time"], ignore_eos=True)
    assert len(seq.output_ids) == NEW_TOKENS


def test_greedy_tokens_on_cuda_equal_transformers_generate_in_fp32(tiny_llama):
    model = load_model(tiny_llama, CUDA, torch.float32)
    engine = make_engine(model, tiny_llama)
    seqs = run(engine, texts(12))
    assert engine.runner.k_cache.is_cuda
    assert max(len(s.prompt_ids) for s in seqs) > 32  # some prompts were prefilled in chunks
    for seq in seqs:
        assert seq.output_ids == generate(model, seq.prompt_ids), seq.id


def test_bf16_runs_a_batch_on_cuda_close_to_fp32(tiny_llama):
    prompts = texts(8, seed=1)
    fp32 = run(make_engine(load_model(tiny_llama, CUDA, torch.float32), tiny_llama), prompts, ignore_eos=True)
    engine = make_engine(load_model(tiny_llama, CUDA, torch.bfloat16), tiny_llama)
    bf16 = run(engine, prompts, ignore_eos=True)
    assert engine.runner.k_cache.dtype == torch.bfloat16 and engine.runner.k_cache.is_cuda
    assert all(len(s.output_ids) == NEW_TOKENS for s in bf16)
    # bf16 rounds the logits, so a near tie can go the other way; most first tokens still agree.
    agree = sum(a.output_ids[0] == b.output_ids[0] for a, b in zip(fp32, bf16))
    assert agree >= 6, [(a.output_ids[:4], b.output_ids[:4]) for a, b in zip(fp32, bf16)]


def test_seeded_sampling_on_cuda_is_the_same_in_any_batch(tiny_llama):
    model = load_model(tiny_llama, CUDA, torch.float32)
    params = {"temperature": 1.0, "top_p": 0.9, "seed": 42}
    alone = run(make_engine(model, tiny_llama), ["Once upon a time"], **params)[0].output_ids
    crowd = run(make_engine(model, tiny_llama), texts(5, seed=3) + ["Once upon a time"], **params)
    assert crowd[5].output_ids == alone


def test_decode_graphs_replay_the_eager_steps_tokens_in_fp32(tiny_llama):
    model = load_model(tiny_llama, CUDA, torch.float32)
    prompts = texts(12, seed=5)
    engine = make_engine(model, tiny_llama, graphs=True)
    replayed = run(engine, prompts)
    graphs = engine.runner.graphs
    assert graphs.capture and graphs.steps > NEW_TOKENS
    assert len({batch for batch, _ in graphs.graphs}) >= 2  # the batch grows and shrinks over buckets
    eager = run(make_engine(model, tiny_llama), prompts)
    assert [s.output_ids for s in replayed] == [s.output_ids for s in eager]
    for seq in replayed:
        assert seq.output_ids == generate(model, seq.prompt_ids), seq.id


def test_decode_graphs_run_bf16_and_seeded_sampling(tiny_llama):
    model = load_model(tiny_llama, CUDA, torch.bfloat16)
    params = {"temperature": 1.0, "top_p": 0.9, "seed": 7, "ignore_eos": True}
    engine = make_engine(model, tiny_llama, graphs=True)
    crowd = run(engine, texts(6, seed=4) + ["Once upon a time"], **params)
    assert engine.runner.graphs.steps > 0
    assert all(len(s.output_ids) == NEW_TOKENS for s in crowd)
    again = run(make_engine(model, tiny_llama, graphs=True), texts(6, seed=4) + ["Once upon a time"], **params)
    assert [s.output_ids for s in again] == [s.output_ids for s in crowd]  # replays are deterministic
