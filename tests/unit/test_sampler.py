import math

import pytest
import torch

from shared.messages import RequestPayload
from shared.sampling import SamplingParams
from worker.engine.detokenizer import Detokenizer
from worker.engine.random_streams import make_generator
from worker.engine.sampler import SamplingBatch, SamplingRow, sample_verify
from worker.engine.sequence import Sequence

LOGITS = torch.tensor([0.1, 2.0, 0.5, 1.9, -1.0])
CPU = torch.device("cpu")



def verify(logits, seqs, drafts, generators, draft_probs):
    """sample_verify over a batch of these requests, with these random streams and proposals."""
    rows = [SamplingRow.of(s, g) for s, g in zip(seqs, generators)]
    return sample_verify(logits, SamplingBatch(rows, drafts, draft_probs))

def sample_batch(logits, seqs, generators):
    """The next token of each row (nothing proposed) and its log-probabilities, as plain sampling."""
    picked = verify(logits, seqs, [[] for _ in seqs], generators, [None] * len(seqs))
    return [tokens[0] for tokens, _ in picked], [lps[0] for _, lps in picked]


def seq(outputs=(), prompt=(0,), **params) -> Sequence:
    s = Sequence.of(RequestPayload(id="r", model="m", prompt_token_ids=list(prompt), params=SamplingParams(**params)),
                    Detokenizer(lambda ids: ""))
    for t in outputs:
        s.append(t)
    return s


def draw(s: Sequence, n: int = 50, logits=LOGITS) -> list[int]:
    gen = make_generator(s.params, CPU)
    return [sample_batch(logits[None], [s], [gen])[0][0] for _ in range(n)]


def test_greedy_takes_the_argmax():
    s = seq(temperature=0)
    assert make_generator(s.params, CPU) is None
    assert draw(s, 3) == [1, 1, 1]


def test_top_k_one_is_greedy_whatever_the_temperature():
    assert set(draw(seq(temperature=3.0, top_k=1, seed=1))) == {1}


def test_small_top_p_keeps_only_the_most_likely_token():
    assert set(draw(seq(temperature=1.0, top_p=0.05, seed=3))) == {1}


def test_min_p_drops_unlikely_tokens():
    # p(3)/p(1) = e^-0.1 ≈ 0.9: min_p 0.85 keeps both, nothing else.
    assert set(draw(seq(temperature=1.0, min_p=0.85, seed=4), 200)) == {1, 3}


def test_top_k_excludes_the_rest():
    assert set(draw(seq(temperature=2.0, top_k=2, seed=5), 200)) == {1, 3}


def test_same_seed_same_samples_alone_or_in_a_batch():
    alone = draw(seq(temperature=1.0, seed=1234), 40)
    assert len(set(alone)) > 1  # it does sample, not argmax
    rows = [seq(temperature=1.0, seed=1234), seq(temperature=0.7), seq(temperature=0)]
    gens = [make_generator(r.params, CPU) for r in rows]
    batch = torch.stack([LOGITS, LOGITS.flip(0), LOGITS])
    together = [sample_batch(batch, rows, gens)[0][0] for _ in range(40)]
    assert together == alone


def test_logit_bias_forces_and_bans():
    assert draw(seq(temperature=0, logit_bias={4: 100}), 1) == [4]
    assert draw(seq(temperature=0, logit_bias={1: -100}), 1) == [3]


def test_ban_tokens_processor():
    s = seq(temperature=1.0, seed=9, logits_processors=[{"name": "ban_tokens", "token_ids": [1, 3]}])
    assert not {1, 3} & set(draw(s, 200))


def test_repetition_penalty_moves_greedy_off_a_seen_token():
    assert draw(seq(temperature=0, prompt=[1], repetition_penalty=1.2), 1) == [3]
    assert draw(seq(temperature=0, prompt=[1]), 1) == [1]


def test_presence_and_frequency_penalties_count_outputs():
    assert draw(seq([1], temperature=0, presence_penalty=0.2), 1) == [3]
    assert draw(seq([1], temperature=0, frequency_penalty=0.05), 1) == [1]  # 2.0 - 0.05 > 1.9
    assert draw(seq([1, 1, 1], temperature=0, frequency_penalty=0.05), 1) == [3]


def test_logprobs_are_the_raw_distribution():
    s = seq(temperature=0, logprobs=2)
    tokens, logprobs = sample_batch(LOGITS[None], [s], [None])
    expected = torch.log_softmax(LOGITS, -1)
    assert tokens == [1]
    assert math.isclose(logprobs[0].logprob, float(expected[1]), rel_tol=1e-6)
    assert [t for t, _ in logprobs[0].top] == [1, 3]
    assert sample_batch(LOGITS[None], [seq(temperature=0)], [None])[1] == [None]


def test_a_broken_row_cannot_fail_the_batch():
    rows = [seq(temperature=1.0, seed=1), seq(temperature=1.0, seed=2)]
    gens = [make_generator(r.params, CPU) for r in rows]
    logits = torch.stack([torch.tensor([float("nan")] * 5), LOGITS])
    tokens, _ = sample_batch(logits, rows, gens)
    assert len(tokens) == 2 and 0 <= tokens[0] < 5


def test_a_tiny_temperature_is_greedy():
    s = seq(temperature=1e-300)
    assert s.params.greedy and draw(s, 2) == [1, 1]


# -- verifying proposed tokens (speculative decoding) ----------------------------------------
P = torch.tensor([0.5, 0.3, 0.2])
UNIFORM = torch.full((3,), 1 / 3)


def test_greedy_verification_keeps_the_agreeing_prefix_and_adds_the_models_token():
    s = seq(temperature=0)
    onehot = torch.eye(3) * 5  # row i: the model picks token i
    [(tokens, lps)] = verify(onehot[[2, 0, 1]], [s], [[2, 1]], [None], [None])
    assert tokens == [2, 0] and lps == [None, None]  # 2 agreed, 1 did not: the model's 0 instead
    [(tokens, _)] = verify(onehot[[2, 0, 1]], [s], [[2, 0]], [None], [None])
    assert tokens == [2, 0, 1]  # all agreed, plus a bonus token


def test_verification_reports_each_emitted_tokens_own_logprob():
    s = seq(temperature=0, logprobs=1)
    logits = torch.log(torch.stack([P, UNIFORM]))
    [(tokens, lps)] = verify(logits, [s], [[0]], [None], [None])
    assert tokens == [0, 0]
    assert math.isclose(lps[0].logprob, math.log(0.5), rel_tol=1e-5)
    assert math.isclose(lps[1].logprob, math.log(1 / 3), rel_tol=1e-5)


@pytest.mark.parametrize("with_draft", [False, True], ids=["lookup", "draft"])
def test_sampled_verification_keeps_the_models_distribution(with_draft):
    """The first emitted token, over many seeded trials, is distributed as the model's p, whether
    a lookup proposed token 2 for certain or a draft model drew its proposal from its own q."""
    q = torch.tensor([0.1, 0.1, 0.8])
    s = seq(temperature=1.0, seed=20261130)
    gen = make_generator(s.params, CPU)
    proposals = torch.multinomial(q, TRIALS, replacement=True, generator=torch.Generator().manual_seed(7)).tolist()
    logits = torch.log(torch.stack([P, UNIFORM]))
    counts = [0, 0, 0]
    for proposal in proposals:
        draft = [proposal] if with_draft else [2]
        [(tokens, _)] = verify(logits, [s], [draft], [gen], [q[None] if with_draft else None])
        counts[tokens[0]] += 1
    for token, prob in enumerate(P.tolist()):
        # The binomial standard deviation is ~0.0065 at this size; the seed makes the result fixed.
        assert abs(counts[token] / TRIALS - prob) < 0.025, counts


TRIALS = 6_000


def test_lookup_verification_emits_what_plain_seeded_sampling_would():
    """Each position is drawn from p with the request's own stream, once per emitted token, so
    proposals change how many tokens a step emits, never which."""
    s = seq(temperature=1.0, seed=5)
    rows = torch.log(torch.tensor([[0.4, 0.3, 0.3], [0.2, 0.5, 0.3], [0.3, 0.3, 0.4], [0.6, 0.2, 0.2]]))
    plain_gen = make_generator(s.params, CPU)
    plain = [sample_batch(rows[i][None], [s], [plain_gen])[0][0] for i in range(4)]
    gen = make_generator(s.params, CPU)
    [(tokens, _)] = verify(rows, [s], [plain[:3]], [gen], [None])  # a lookup that guessed right
    assert tokens == plain


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_takes_the_first_of_tied_maxima_as_argmax_does(dtype):
    logits = torch.zeros((3, 50), dtype=dtype)
    logits[0, [7, 9, 30]] = 2.0
    logits[1, [0, 49]] = 1.0
    logits[2, 5], logits[2, 6] = 3.0, 3.0
    seqs = [seq(temperature=0) for _ in range(3)]
    picked = verify(logits, seqs, [[] for _ in seqs], [None] * 3, [None] * 3)
    assert [tokens for tokens, _ in picked] == [[7], [0], [5]]
    assert [t[0] for t, _ in picked] == logits.float().argmax(dim=-1).tolist()


def test_a_spent_thinking_budget_forces_the_end_tag_token_by_token():
    budget = {"tokens": 3, "end": [4, 0]}  # the "end tag": tokens 4 then 0, both far from the argmax (1)
    assert draw(seq([1, 1], temperature=0, thinking_budget=budget), 1) == [1]  # 2 of 3: free
    assert draw(seq([1, 1, 1], temperature=0, thinking_budget=budget), 1) == [4]  # spent: the tag's first
    assert draw(seq([1, 1, 1, 4], temperature=0, thinking_budget=budget), 1) == [0]  # then its next
    assert draw(seq([1, 1, 1, 4, 0], temperature=0, thinking_budget=budget), 1) == [1]  # closed: free again
    assert draw(seq([4, 0, 1, 1, 1], temperature=0, thinking_budget=budget), 1) == [1]  # closed early: free
    assert set(draw(seq([1, 1, 1], temperature=1.5, seed=3, thinking_budget=budget), 20)) == {4}  # sampled too


def test_the_thinking_budget_lets_a_close_begun_by_the_model_go_on():
    from shared.sampling import ThinkingBudget

    budget = ThinkingBudget(tokens=4, end=[7, 8, 9])
    assert budget.forced([1, 2, 7]) is None  # begun before the budget: the model's own
    assert budget.forced([1, 2, 3, 4, 7]) == 8 and budget.forced([1, 2, 3, 4, 7, 8]) == 9
    assert budget.forced([1, 2, 3, 7, 5]) == 7  # a false start, and the budget is spent


def test_a_budget_with_a_start_counts_only_a_reply_that_opens_with_it():
    """Harmony's: a reply that opens on the analysis channel ([5, 6] here) has a thought, counted
    from after its opening; one that opens on another channel has none to close."""
    from shared.sampling import ThinkingBudget

    budget = ThinkingBudget(tokens=2, start=[5, 6], end=[7, 8])
    assert budget.forced([5]) is None and budget.forced([5, 6, 1]) is None  # opening, then within the budget
    assert budget.forced([5, 6, 1, 1]) == 7 and budget.forced([5, 6, 1, 1, 7]) == 8
    assert budget.forced([5, 6, 1, 1, 7, 8, 1, 1, 1]) is None  # closed: the answer runs free
    assert budget.forced([5, 9, 1, 1, 1]) is None and budget.forced([1, 1, 1, 1]) is None  # no thought opened
