"""Speculative decoding's pure pieces with plain numbers: proposing by prompt lookup, greedy
acceptance, and the plan that puts proposals on a step's decodes and rolls back rejected ones."""
import itertools

import pytest

from shared.messages import RequestPayload
from shared.sampling import SamplingParams
from worker.engine.batcher import Batcher
from worker.engine.block_manager import BlockManager
from worker.engine.detokenizer import Detokenizer
from worker.engine.sequence import Sequence
from worker.engine.acceptance import accept_greedy
from worker.engine.speculation import NgramProposer, Speculator, propose_ngram

_ids = itertools.count()


def test_lookup_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    #         0  1  2  3  4  5  6  7  8  9  10
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7]
    # Suffix [6, 7]: latest earlier match at 6-7, followed by 2, 6, 7.
    assert propose_ngram(tokens, k=3, max_n=2) == [2, 6, 7]
    # A longer suffix that matches wins over a later short match.
    assert propose_ngram([1, 2, 3, 9, 3, 1, 2, 3], k=2, max_n=3) == [9, 3]
    assert propose_ngram([1, 2, 3], k=2) == []  # nothing repeats
    assert propose_ngram([4, 4], k=5) == [4]  # no more than what follows
    assert propose_ngram([1, 2, 3, 9, 3], k=2, min_n=2) == []  # only a 1-gram matches
    with pytest.raises(ValueError, match="min_n"):
        propose_ngram([1, 2], k=2, min_n=3, max_n=2)


def test_greedy_keeps_the_agreeing_prefix_and_the_models_next_token():
    assert accept_greedy([3, 4, 5], [3, 4, 5, 6]) == [3, 4, 5, 6]  # all kept, plus a bonus token
    assert accept_greedy([3, 4, 5], [3, 9, 5, 6]) == [3, 9]  # the correction replaces the first miss
    assert accept_greedy([], [7]) == [7]  # nothing proposed: plain decoding
    with pytest.raises(ValueError):
        accept_greedy([1, 2], [1, 2])


def seq(tokens: list[int], **params) -> Sequence:
    """A request whose prompt is tokens[:-1]; its prefill will emit tokens[-1]."""
    payload = RequestPayload(id=f"s{next(_ids)}", model="m", prompt_token_ids=tokens[:-1],
                             params=SamplingParams(**{"max_tokens": 100, "temperature": 0, **params}))
    s = Sequence.of(payload, Detokenizer(lambda ids: ""))
    FIRST[s.id] = tokens[-1]
    return s


FIRST: dict[str, int] = {}


REPEATING = [10, 11, 12, 13, 14, 15, 16, 17, 10, 11]  # lookup proposes 12, 13, 14, 15


def decoding(batcher: Batcher, *seqs: Sequence) -> None:
    """Admit and prefill the requests, as the engine would, so the next step decodes them."""
    for s in seqs:
        batcher.add(s)
    while any(not s.output_ids for s in seqs):
        out = batcher.schedule()
        for chunk in out.chunks:
            batcher.computed(chunk)
            if chunk.samples:
                chunk.seq.append(FIRST[chunk.seq.id])


def test_proposals_ride_on_decodes_and_rejected_ones_give_their_blocks_back():
    blocks = BlockManager(32, 4)
    batcher = Batcher(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    spec = Speculator(NgramProposer(4, min_n=2, max_n=3), max_k=4)
    s = seq(REPEATING)
    decoding(batcher, s)
    out = batcher.schedule()
    spec.propose(out, batcher, context_length=256)
    [chunk] = out.chunks
    assert chunk.draft == [12, 13, 14, 15] and chunk.length == 5
    assert chunk.input_ids == [11, 12, 13, 14, 15] and chunk.num_logits == 5
    assert len(blocks.table(s.id)) == 4  # room for 14 tokens
    batcher.computed(chunk, kept=1)  # 12 kept, 13 rejected: the model emits 12 and its own token
    spec.settle(chunk, kept=1)
    assert s.num_computed == 11 and len(blocks.table(s.id)) == 3  # 12 tokens need 3 blocks
    assert blocks.num_free == 29
    assert (spec.stats.drafts, spec.stats.proposed, spec.stats.accepted) == (1, 4, 1)


def test_proposal_length_adapts_to_each_requests_acceptance():
    batcher = Batcher(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64)
    spec = Speculator(NgramProposer(8, min_n=1, max_n=3), max_k=8)
    s = seq(REPEATING * 3)
    decoding(batcher, s)
    lengths = []
    for kept_all in (False, False, True):
        out = batcher.schedule()
        spec.propose(out, batcher, context_length=256)
        [chunk] = out.chunks
        lengths.append(len(chunk.draft))
        kept = len(chunk.draft) if kept_all else 0
        batcher.computed(chunk, kept)
        spec.settle(chunk, kept)
        for t in chunk.draft[:kept]:
            s.append(t)
        s.append(10 + (s.token_ids[-1] - 9) % 8)  # the model's own token: the pattern goes on
    out = batcher.schedule()
    spec.propose(out, batcher, context_length=256)
    assert lengths == [8, 7, 6] and len(out.chunks[0].draft) == 8  # -1, -1, then +2 (capped at 8)


def test_speculation_never_preempts_and_stays_within_the_budget_and_the_limits():
    blocks = BlockManager(6, 4)  # 24 token slots
    batcher = Batcher(blocks, max_num_seqs=4, max_num_batched_tokens=64)
    spec = Speculator(NgramProposer(4, min_n=1), max_k=4)
    a, b = seq(REPEATING), seq(REPEATING[:7] + [10, 11])
    decoding(batcher, a, b)
    free = blocks.num_free
    out = batcher.schedule()
    spec.propose(out, batcher, context_length=256)
    assert free == 2 and not out.preempted and blocks.num_free == 0
    # Each had 2 free slots in its last block and took one more block: 6 and 5 slots (a's
    # lookup has 4 tokens to offer, b's 3); nobody was preempted for them.
    assert [len(c.draft) for c in out.chunks] == [4, 3]

    tight = Batcher(BlockManager(32, 4), max_num_seqs=1, max_num_batched_tokens=3)
    spec = Speculator(NgramProposer(4, min_n=1), max_k=4)
    s = seq(REPEATING)
    decoding(tight, s)
    out = tight.schedule()
    spec.propose(out, tight, context_length=256)
    assert out.num_tokens == 3  # the step's budget

    short = Batcher(BlockManager(32, 4), max_num_seqs=4, max_num_batched_tokens=64)
    s = seq(REPEATING, max_tokens=3)  # after its first token two more may come: one proposed at most
    decoding(short, s)
    out = short.schedule()
    spec.propose(out, short, context_length=256)
    assert out.chunks[0].draft == [12]


def test_requests_that_opt_out_or_use_penalties_decode_plainly():
    batcher = Batcher(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64)
    spec = Speculator(NgramProposer(4, min_n=1), max_k=4)
    plain = [seq(REPEATING, speculative=False), seq(REPEATING, repetition_penalty=1.2), seq(REPEATING)]
    decoding(batcher, *plain)
    out = batcher.schedule()
    spec.propose(out, batcher, context_length=256)
    assert [len(c.draft) for c in out.chunks] == [0, 0, 4]


def test_speculation_pauses_while_the_batch_is_bigger_than_its_limit():
    batcher = Batcher(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64)
    spec = Speculator(NgramProposer(4, min_n=1), max_k=4, disable_by_batch_size=1)
    a, b = seq(REPEATING), seq(REPEATING)
    decoding(batcher, a, b)
    out = batcher.schedule()
    spec.propose(out, batcher, context_length=256)
    assert [len(c.draft) for c in out.chunks] == [0, 0]  # two running, more than 1
    batcher.remove(b)
    batcher.computed(out.chunks[0])
    a.append(12)
    out = batcher.schedule()
    spec.propose(out, batcher, context_length=256)
    assert [len(c.draft) for c in out.chunks] == [4]  # alone again: it speculates
