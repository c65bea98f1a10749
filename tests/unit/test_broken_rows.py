"""A request whose own sampling parameters break its sampling fails alone: its neighbours in
the step get exactly the tokens they get without it (greedy and seeded), in both engines.

The api refuses these parameters; the payloads here skip its validation (model_construct),
as a payload from an older api, or a bug, would.
"""
from __future__ import annotations

import pytest
import torch

from shared.messages import FinishReason, RequestPayload, TokenEvent
from shared.sampling import SamplingParams
from shared.tokenizer import Tokenizer
from tests.unit.test_engine import make_engine
from worker.model.model_loader import load_model
from worker.backends.static_engine import BatchRunner
from worker.backends.static_engine import StaticEngine

GOOD = [("Once upon a time", {"temperature": 0}), ("The capital of France", {"temperature": 1.0, "seed": 7}),
        ("Streams and caches", {"temperature": 0.8, "top_k": 20, "seed": 8, "logprobs": 2}),
        ("안녕 😀", {"temperature": 0})]
# Each breaks the sampler in its own place: filtering, bias (greedy rows too), log-probabilities.
BAD = [{"temperature": 1.0, "top_k": 10**30}, {"temperature": 1.0, "min_p": 10**30},
       {"temperature": 0, "logit_bias": {5: 10**30}}, {"temperature": 0, "logprobs": 10**6}]


def payload(i: int, tok: Tokenizer, text: str, params: SamplingParams) -> RequestPayload:
    return RequestPayload(id=f"r{i}", model="m", prompt_token_ids=tok.encode(text), params=params)


def good(i: int, tok: Tokenizer) -> RequestPayload:
    text, params = GOOD[i]
    return payload(i, tok, text, SamplingParams(max_tokens=12, **params))


def bad(i: int, tok: Tokenizer) -> RequestPayload:
    unchecked = SamplingParams.model_construct(**{**SamplingParams().model_dump(), "max_tokens": 12, **BAD[i]})
    return payload(100 + i, tok, "a poisoned request", unchecked)


def drain(engine, payloads: list[RequestPayload]) -> dict[str, tuple]:
    return {g.request_id: (g.finish_reason, g.output_ids, g.error) for g in engine.generate(payloads)}


def continuous(model_dir):
    return make_engine(model_dir)


def static(model_dir):
    model = load_model(model_dir, torch.device("cpu"), torch.float32)
    return StaticEngine(BatchRunner(model, torch.device("cpu"), pad_id=2), Tokenizer(model_dir), batch_size=8)


@pytest.mark.parametrize("build", [continuous, static])
def test_a_broken_row_fails_alone_and_its_neighbours_keep_their_exact_tokens(tiny_llama, build):
    tok = Tokenizer(tiny_llama)
    alone = drain(build(tiny_llama), [good(i, tok) for i in range(len(GOOD))])
    assert all(reason != FinishReason.ERROR and out for reason, out, _ in alone.values())
    engine = build(tiny_llama)
    # Bad rows between the good ones, so a row's position in the batch moves too.
    mixed = [p for i in range(len(GOOD)) for p in (good(i, tok), bad(i, tok))]
    ended = drain(engine, mixed)
    for i in range(len(BAD)):
        reason, out, error = ended[f"r{100 + i}"]
        assert reason == FinishReason.ERROR and out == [] and error.startswith("sampling failed"), BAD[i]
    assert {rid: ended[rid] for rid in alone} == alone
    if build is continuous:
        assert engine.batcher.blocks.num_free == len(engine.batcher.blocks.blocks)  # failed rows' KV given back


def test_a_row_that_breaks_after_some_tokens_fails_then_alone(tiny_llama):
    """A presence penalty only applies once there are outputs: the row fails at its second
    token, keeping its first, and its neighbours carry on unchanged."""
    tok = Tokenizer(tiny_llama)
    alone = drain(make_engine(tiny_llama), [good(0, tok), good(1, tok)])
    late = SamplingParams.model_construct(**{**SamplingParams(temperature=0, max_tokens=12).model_dump(),
                                             "presence_penalty": 10**30})
    ended = drain(make_engine(tiny_llama), [good(0, tok), payload(9, tok, GOOD[0][0], late), good(1, tok)])
    reason, out, _ = ended["r9"]
    assert reason == FinishReason.ERROR and out == alone["r0"][1][:1]
    assert {rid: ended[rid] for rid in alone} == alone


@pytest.mark.parametrize("build", [continuous, static])
def test_a_seeded_request_continued_after_k_tokens_draws_what_the_undisturbed_run_drew(tiny_llama, build):
    """A worker taking over a seeded request moves its random stream past the draws of the tokens
    already delivered: the continuation is the undisturbed run's (fp32, the prefill of prompt and
    delivered tokens gives the decode's distributions to within rounding)."""
    tok = Tokenizer(tiny_llama)
    request = payload(0, tok, "The capital of France", SamplingParams(max_tokens=16, temperature=1.0, seed=11))
    whole = drain(build(tiny_llama), [request])[request.id][1]
    assert len(whole) == 16
    for k in (1, 5, 12):
        engine = build(tiny_llama)
        delivered = [TokenEvent(index=i, token_id=t, text="") for i, t in enumerate(whole[:k])]
        [seq] = engine.generate([request], resumed=[delivered])
        assert seq.output_ids == whole, f"continued after {k} tokens"
