"""Every numeric sampling parameter is bounded at the edge, with an error that names it."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from api.core.errors import ApiError
from api.core.generation import Generation
from api.openai.schemas import ChatCompletionRequest, CompletionRequest
from api.native.seed import QueryRequest
from shared.sampling import MAX_SEED, SamplingParams

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("field, value", [
    ("top_k", 10**30), ("seed", 2**70), ("seed", -1), ("max_tokens", 10**30), ("stop_token_ids", [10**30]),
    ("logit_bias", {10**30: 1.0}), ("logit_bias", {3: NAN}), ("logit_bias", {3: INF}),
    ("logits_processors", [{"name": "ban_tokens", "token_ids": [10**30]}]),
    ("temperature", NAN), ("top_p", NAN), ("min_p", NAN), ("repetition_penalty", INF),
    ("presence_penalty", -INF), ("frequency_penalty", NAN), ("logprobs", 10**30),
])
def test_sampling_params_refuse_out_of_range_and_non_finite_values(field, value):
    with pytest.raises(ValidationError) as caught:
        SamplingParams(**{field: value})
    assert caught.value.errors()[0]["loc"][0] == field


def test_non_finite_numbers_in_json_are_refused():
    with pytest.raises(ValidationError, match="finite"):
        SamplingParams.model_validate_json('{"logit_bias": {"3": Infinity}}')


@pytest.mark.parametrize("body", [{"top_k": 10**30}, {"seed": 2**70}, {"temperature": NAN},
                                  {"stop_token_ids": [10**30]}, {"max_tokens": 10**30}])
def test_openai_bodies_refuse_them_too(body):
    for schema, extra in [(CompletionRequest, {"prompt": "x"}),
                          (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})]:
        with pytest.raises(ValidationError) as caught:
            schema(**extra, **body)
        assert caught.value.errors()[0]["loc"][0] == next(iter(body))


def test_seed_tutorial_bodies_bound_the_seed():
    with pytest.raises(ValidationError, match="seed"):
        QueryRequest(query="x", seed=2**70)


def test_each_samples_seed_stays_in_range():
    """Sample i is seeded seed + i; at the top of the range it wraps instead of failing."""
    body = CompletionRequest(prompt="x", seed=MAX_SEED, n=3)
    assert [body.sampling(4, None, i).seed for i in range(3)] == [MAX_SEED, 0, 1]


class _Tokenizer:
    vocab_size, context_length = 400, 256


@pytest.mark.parametrize("field, value", [("top_k", 401), ("logprobs", 20)])
def test_counts_past_the_vocabulary_are_a_422_naming_the_field(field, value):
    tokenizer = _Tokenizer()
    tokenizer.vocab_size = 400 if field == "top_k" else 16
    generation = Generation(None, None, tokenizer, "m", default_max_tokens=16)
    with pytest.raises(ApiError) as caught:
        generation.build([1, 2, 3], SamplingParams(**{field: value}))
    error = caught.value
    assert (error.status, error.param) == (422, field)
    assert f"vocabulary size, {tokenizer.vocab_size}" in error.message
    generation.build([1, 2, 3], SamplingParams(**{field: tokenizer.vocab_size}))  # the vocabulary itself is fine
