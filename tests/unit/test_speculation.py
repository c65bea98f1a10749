"""Proposing and accepting speculative tokens, with plain numbers."""
import random
from collections import Counter

import pytest

from worker.speculation import accept_greedy, accept_sampled, propose_ngram


def test_lookup_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    # Suffix [6, 7]: latest earlier match at 6-7, followed by 2, 6, 7.
    assert propose_ngram(tokens, k=3, max_n=2) == [2, 6, 7]
    # A longer suffix that matches wins over a later short match.
    assert propose_ngram([1, 2, 3, 9, 3, 1, 2, 3], k=2, max_n=3) == [9, 3]
    assert propose_ngram([1, 2, 3], k=2) == []  # nothing repeats
    assert propose_ngram([4, 4], k=5) == [4]  # no more than what follows


def test_greedy_keeps_the_agreeing_prefix_and_the_models_next_token():
    assert accept_greedy([3, 4, 5], [3, 4, 5, 6]) == [3, 4, 5, 6]  # all kept, plus a bonus token
    assert accept_greedy([3, 4, 5], [3, 9, 5, 6]) == [3, 9]  # the correction replaces the first miss
    assert accept_greedy([], [7]) == [7]  # nothing proposed: plain decoding
    with pytest.raises(ValueError):
        accept_greedy([1, 2], [1, 2])


@pytest.mark.parametrize("with_draft", [False, True], ids=["lookup", "draft"])
def test_sampling_keeps_the_models_distribution(with_draft):
    """The first emitted token, over many seeded trials, is distributed as the model's p, whether
    a lookup proposed token 2 for certain or a draft model drew its proposal from its own q."""
    p = [0.5, 0.3, 0.2]
    q = [0.1, 0.1, 0.8]
    rng = random.Random(20261130)
    trials = 40_000

    def first_token() -> int:
        if not with_draft:
            return accept_sampled([2], [p, [1 / 3] * 3], rng)[0]
        proposal = rng.choices(range(3), weights=q)[0]
        return accept_sampled([proposal], [p, [1 / 3] * 3], rng, draft=[q, [1 / 3] * 3])[0]
    counts = Counter(first_token() for _ in range(trials))
    for token, prob in enumerate(p):
        # Binomial standard deviation is ~0.0025 at this size; the seed makes the result fixed.
        assert abs(counts[token] / trials - prob) < 0.015, counts


def test_a_certain_model_keeps_every_proposed_token_and_adds_one():
    rng = random.Random(1)
    certain = [[0, 1.0, 0], [0, 0, 1.0], [1.0, 0, 0]]
    assert accept_sampled([1, 2], certain, rng) == [1, 2, 0]
    impossible = [[1.0, 0, 0], [0, 0, 1.0], [1.0, 0, 0]]
    assert accept_sampled([1, 2], impossible, rng) == [0]  # rejected at once, replaced from p
