"""The continuous engine in-process on tiny models: greedy output equals transformers'
generate token for token, whatever the arrival order, chunking, preemption or prefix sharing."""
from __future__ import annotations

import functools
import random

import pytest
import torch

from shared.messages import FinishReason, RequestPayload, TokenEvent
from shared.sampling import SamplingParams
from shared.tokenizer import Tokenizer
from worker.engine.batcher import Batcher
from worker.engine.block_manager import BlockManager
from worker.engine.core import Engine
from worker.model import kernels
from worker.model.model_runner import PagedRunner
from worker.model.model_loader import load_model

WORDS = "once upon a time the capital of France is Paris and Seoul streams batches caches 안녕 😀 🚀".split()
NEW_TOKENS = 16


def prompts(n: int, seed: int = 0, prefix: str = "") -> list[str]:
    rng = random.Random(seed)
    return [prefix + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) for _ in range(n)]


@functools.cache
def reference(folder: str, prompt_ids: tuple[int, ...]) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = _hf_model(folder)
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    del AutoModelForCausalLM
    return out[0, len(prompt_ids):].tolist()


@functools.cache
def _hf_model(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def make_engine(folder, num_blocks=256, block_size=4, batch=8, budget=32, prefix_caching=True) -> Engine:
    model = load_model(folder, torch.device("cpu"), torch.float32)
    runner = PagedRunner(model, torch.device("cpu"), num_blocks, block_size, kernels.load())
    return Engine(runner, Tokenizer(folder), Batcher(BlockManager(num_blocks, block_size, prefix_caching), batch, budget))


def run(engine: Engine, texts: list[str], arrive_every: int = 1, **params) -> list:
    """Submit one prompt every `arrive_every` steps, then run to the end."""
    tok = engine.tokenizer
    seqs, pending = [], list(enumerate(texts))
    steps = 0
    while pending or engine.has_work():
        if pending and steps % arrive_every == 0:
            i, text = pending.pop(0)
            p = SamplingParams(**{"temperature": 0, "max_tokens": NEW_TOKENS, **params})
            seqs.append(engine.add(RequestPayload(id=f"r{i}", model="m", prompt_token_ids=tok.encode(text), params=p)))
        engine.step()
        steps += 1
    return seqs


@pytest.fixture(params=["llama", "opt"])
def model_dir(request, tiny_llama, tiny_opt):
    return tiny_llama if request.param == "llama" else tiny_opt


def _check(model_dir, seqs):
    for seq in seqs:
        assert seq.output_ids == reference(str(model_dir), tuple(seq.prompt_ids)), seq.id


def test_staggered_arrivals_and_chunked_prefill_match_transformers(model_dir):
    engine = make_engine(model_dir, budget=16)  # prompts up to ~80 tokens: prefilled in chunks
    seqs = run(engine, prompts(16), arrive_every=2)
    _check(model_dir, seqs)
    assert max(len(s.prompt_ids) for s in seqs) > 16


def test_preemption_from_a_tiny_block_budget_keeps_outputs_exact(model_dir):
    engine = make_engine(model_dir, num_blocks=40, block_size=4, batch=8, budget=64)
    seqs = run(engine, prompts(16, seed=1), arrive_every=1)
    assert engine.batcher.num_preemptions > 0
    _check(model_dir, seqs)


def test_prefix_sharing_keeps_outputs_exact(model_dir):
    engine = make_engine(model_dir)
    system = "the capital of France is Paris and Seoul streams batches caches once upon a time "
    seqs = run(engine, prompts(8, seed=2, prefix=system), arrive_every=3)
    assert engine.batcher.blocks.prefix_hits >= 7 * 4
    _check(model_dir, seqs)


def test_seeded_sampling_is_the_same_in_any_batch(tiny_llama):
    alone = run(make_engine(tiny_llama), ["Once upon a time"], temperature=1.0, seed=42)[0].output_ids
    engine = make_engine(tiny_llama)
    crowd = run(engine, prompts(5, seed=3) + ["Once upon a time"] + prompts(3, seed=4), temperature=1.0, seed=42)
    assert crowd[5].output_ids == alone
    assert crowd[0].output_ids != alone


def test_a_request_larger_than_the_cache_fails_clearly(tiny_llama):
    engine = make_engine(tiny_llama, num_blocks=4, block_size=4)
    [seq] = run(engine, ["one two three"], max_tokens=30)
    assert seq.finish_reason.value == "error" and "16" in seq.error


def test_generate_runs_every_prompt_to_its_end_and_answers_in_their_order(tiny_llama):
    """Engine.generate: text, token ids or a whole payload in (more prompts than the batch holds),
    each request's tokens, text, finish reason and token events out, in the prompts' order."""
    engine = make_engine(tiny_llama, batch=3)
    tok = engine.tokenizer
    texts = prompts(5, seed=5)
    own = RequestPayload(id="own", model="m", prompt_token_ids=tok.encode(texts[4]),
                         params=SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0))
    out = engine.generate([texts[0], tok.encode(texts[1]), texts[2], tok.encode(texts[3]), own],
                          SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    assert not engine.has_work()
    for got, text in zip(out[:4], texts):
        assert got.output_ids == reference(str(tiny_llama), tuple(tok.encode(text)))
        assert got.text == tok.decode(got.output_ids)
        assert [t.token_id for t in got.tokens] == got.output_ids
        assert got.finish_reason is (FinishReason.LENGTH if len(got.output_ids) == NEW_TOKENS else FinishReason.STOP)
    assert len({got.request_id for got in out}) == 5
    last = out[4]
    assert last.request_id == "own" and last.finish_reason is FinishReason.LENGTH and last.error is None
    assert last.output_ids == reference(str(tiny_llama), tuple(own.prompt_token_ids))[:3]
    assert [t.index for t in last.tokens] == [0, 1, 2] and all(t.logprob is not None for t in last.tokens)


def test_generate_continues_a_request_from_its_delivered_tokens(tiny_llama):
    """`resumed`, as after a failover: the output is the undisturbed one's, the delivered tokens
    included, and only the new tokens are emitted."""
    engine = make_engine(tiny_llama)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    [whole] = engine.generate(["Once upon a time"], params)
    delivered = [TokenEvent(index=i, token_id=t, text="") for i, t in enumerate(whole.output_ids[:5])]
    [continued] = make_engine(tiny_llama).generate(["Once upon a time"], params, resumed=[delivered])
    assert continued.output_ids == whole.output_ids
    assert [t.index for t in continued.tokens] == list(range(5, NEW_TOKENS))


def test_generate_ends_a_request_it_cannot_run_with_its_error(tiny_llama):
    [seq] = make_engine(tiny_llama, num_blocks=4, block_size=4).generate(
        ["one two three"], SamplingParams(temperature=0, max_tokens=30))
    assert seq.finish_reason is FinishReason.ERROR and "16" in seq.error and seq.output_ids == []
