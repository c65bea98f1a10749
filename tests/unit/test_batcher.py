"""The batcher, driven with plain numbers: no torch, no Redis."""
import itertools

import pytest

from shared.messages import RequestPayload
from shared.sampling import SamplingParams
from worker.engine.batcher import FLEX_CHUNK_BESIDE_PRIORITY, PRIORITY_HOLD_S, Batcher
from worker.engine.block_manager import BlockManager
from worker.engine.detokenizer import Detokenizer
from worker.engine.sequence import Sequence, Status

_ids = itertools.count()


def seq(prompt_len: int, first: int = 1000, tier: str = "default") -> Sequence:
    n = next(_ids)
    payload = RequestPayload(id=f"r{n}", model="m", prompt_token_ids=list(range(first + n * 1000, first + n * 1000 + prompt_len)),
                             params=SamplingParams(max_tokens=8), service_tier=tier)
    return Sequence.of(payload, Detokenizer(lambda ids: ""))


def step(batcher: Batcher, new_token: int = 7):
    """Schedule, 'run', update; sampled chunks get a new token, as the engine does."""
    out = batcher.schedule()
    for chunk in out.chunks:
        batcher.computed(chunk)
        if chunk.samples:
            chunk.seq.append(new_token)
    return out


def lengths(out):
    return {c.seq.id: c.length for c in out.chunks}


def test_admits_up_to_batch_size_and_refills_a_finished_slot_next_step():
    b = Batcher(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=64)
    s1, s2, s3 = seq(3), seq(3), seq(3)
    for s in (s1, s2, s3):
        b.add(s)
    out = step(b)
    assert lengths(out) == {s1.id: 3, s2.id: 3}
    assert lengths(step(b)) == {s1.id: 1, s2.id: 1}  # decodes
    b.remove(s1)  # finished
    assert lengths(step(b)) == {s2.id: 1, s3.id: 3}  # its slot is refilled at once


def test_long_prompts_are_prefilled_in_chunks_while_decodes_keep_flowing():
    b = Batcher(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=8)
    short = seq(2)
    b.add(short)
    step(b)
    long = seq(20)
    b.add(long)
    sizes = []
    while long.num_computed < 20:
        out = step(b)
        assert lengths(out)[short.id] == 1  # the running decode is never held up
        sizes.append(lengths(out)[long.id])
        assert not [c for c in out.chunks if c.seq is long and c.samples] or long.num_computed == 20
    assert sizes == [7, 7, 6] and long.output_ids == [7]


def test_out_of_blocks_preempts_the_newest_and_recomputes_it_later():
    b = Batcher(BlockManager(4, 2, prefix_caching=False), max_num_seqs=4, max_num_batched_tokens=64)
    old, new = seq(3), seq(3)
    b.add(old)
    b.add(new)
    step(b)  # each holds 2 blocks: 3 prompt tokens + room for 1
    step(b)  # 5 tokens each now known; the next decode needs a third block each
    out = step(b)
    assert out.preempted == [new] and lengths(out) == {old.id: 1}
    assert new.num_computed == 0 and b.waiting.peek() is new and b.num_preemptions == 1
    b.remove(old)
    known = new.num_tokens
    out = step(b)
    assert lengths(out) == {new.id: known}  # prompt and outputs recomputed
    assert not out.chunks[0].start


def test_a_shared_prefix_skips_its_computed_blocks():
    b = Batcher(BlockManager(32, 4), max_num_seqs=4, max_num_batched_tokens=64)
    first = seq(10)
    b.add(first)
    step(b)
    second = seq(10)
    second.token_ids[:] = first.prompt_ids[:8] + [1, 2]
    b.add(second)
    out = step(b)
    chunk = next(c for c in out.chunks if c.seq is second)
    assert (chunk.start, chunk.length) == (8, 2)
    assert chunk.block_table[:2] == b.blocks.table(first.id)[:2]


def test_token_budget_smaller_than_batch_is_refused():
    with pytest.raises(ValueError, match="max_num_batched_tokens=2"):
        Batcher(BlockManager(4, 4), max_num_seqs=4, max_num_batched_tokens=2)


def test_requests_admitted_in_the_same_step_share_a_prefix():
    b = Batcher(BlockManager(32, 4), max_num_seqs=4, max_num_batched_tokens=64)
    first, second = seq(10), seq(10)
    second.token_ids[:] = first.prompt_ids[:8] + [1, 2]
    b.add(first)
    b.add(second)
    out = step(b)
    chunk = next(c for c in out.chunks if c.seq is second)
    assert (chunk.start, chunk.length) == (8, 2)


def test_clearing_the_prefix_cache_forgets_every_block():
    bm = BlockManager(8, 2)
    bm.append_slots("a", 4)
    bm.register("a", [1, 2, 3, 4], 4)
    bm.clear_prefix_cache()
    assert bm.allocate_prefix("b", [1, 2, 3, 4, 5]) == 0


def test_a_request_waiting_for_its_grammar_is_not_scheduled_until_it_is_marked_waiting():
    b = Batcher(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=64)
    building = seq(3)
    building.status = Status.WAITING_FOR_GRAMMAR
    b.add(building)
    assert building.status is Status.WAITING_FOR_GRAMMAR and not b.has_work()
    free = seq(3)
    b.add(free)
    assert b.has_work() and lengths(step(b)) == {free.id: 3}
    assert lengths(step(b)) == {free.id: 1} and building in b.waiting
    building.status = Status.WAITING  # the engine has its matcher
    assert lengths(step(b)) == {free.id: 1, building.id: 3} and building.status is Status.RUNNING


@pytest.mark.parametrize("tier", ["priority", "default"])
def test_a_better_tier_waiting_for_a_slot_preempts_the_newest_flex_request(tier):
    b = Batcher(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=64)
    old_flex, new_flex = seq(3, tier="flex"), seq(3, tier="flex")
    for s in (old_flex, new_flex):
        b.add(s)
    step(b)
    better = seq(3, tier=tier)
    b.add(better)
    out = step(b)
    assert out.preempted == [new_flex] and new_flex.status is Status.PREEMPTED and new_flex.num_computed == 0
    # Admitted in the same step; beside a priority prompt the other flex request sits the step out.
    assert lengths(out) == ({better.id: 3} if tier == "priority" else {old_flex.id: 1, better.id: 3})
    b.remove(better)
    assert lengths(step(b)) == {old_flex.id: 1, new_flex.id: 4}  # recomputed: its prompt and its token


def test_flex_requests_sit_out_while_a_priority_prompt_runs_and_keep_their_cache():
    b = Batcher(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=8)
    flex, other_flex, default = seq(2, tier="flex"), seq(2, tier="flex"), seq(2)
    for s in (flex, other_flex, default):
        b.add(s)
    step(b)
    prio = seq(12, tier="priority")
    b.add(prio)
    first = step(b)  # the priority prompt's first chunk beside the default decode, no flex one
    assert lengths(first) == {default.id: 1, prio.id: 7} and first.preempted == []
    assert lengths(step(b)) == {default.id: 1, prio.id: 5} and prio.output_ids  # its first token
    assert flex.num_computed == other_flex.num_computed == 2  # kept, not recomputed
    assert lengths(step(b)) == {flex.id: 1, other_flex.id: 1, default.id: 1, prio.id: 1}
    assert b.num_preemptions == 0


def capped(flex_beside_priority: int, blocks: int = 64, budget: int = 64) -> tuple[Batcher, list[float]]:
    """A batcher with flex capped beside priority, on a clock the test moves (clock[0], seconds)."""
    b = Batcher(BlockManager(blocks, 4), max_num_seqs=8, max_num_batched_tokens=budget,
                flex_beside_priority=flex_beside_priority)
    clock = [0.0]
    b.clock = lambda: clock[0]
    return b, clock


def test_beside_a_decoding_priority_request_only_the_oldest_flex_requests_run():
    b, clock = capped(1)
    old_flex, new_flex, default = seq(2, tier="flex"), seq(2, tier="flex"), seq(2)
    for s in (old_flex, new_flex, default):
        b.add(s)
    assert lengths(step(b)) == {old_flex.id: 2, new_flex.id: 2, default.id: 2}  # no priority: no cap
    prio = seq(3, tier="priority")
    b.add(prio)
    assert lengths(step(b)) == {default.id: 1, prio.id: 3}  # its prompt: no flex at all
    late_flex = seq(2, tier="flex")
    b.add(late_flex)
    # It decodes: one flex request beside it, the oldest; the newer ones keep their cache and wait.
    assert lengths(step(b)) == {old_flex.id: 1, default.id: 1, prio.id: 1}
    assert new_flex.num_computed == 2 and late_flex.status is Status.WAITING and b.num_preemptions == 0
    b.remove(old_flex)
    assert lengths(step(b)) == {new_flex.id: 1, default.id: 1, prio.id: 1}
    b.remove(prio)
    # Gone: the cap holds a while (the same client's next request comes soon), then lifts.
    assert lengths(step(b)) == {new_flex.id: 1, default.id: 1}
    clock[0] += PRIORITY_HOLD_S
    assert lengths(step(b)) == {new_flex.id: 1, default.id: 1, late_flex.id: 2}


def test_without_the_cap_flex_requests_decode_beside_a_priority_one():
    b = Batcher(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64)
    flexes = [seq(2, tier="flex") for _ in range(3)]
    prio = seq(2, tier="priority")
    for s in (*flexes, prio):
        b.add(s)
    step(b)
    assert set(lengths(step(b))) == {s.id for s in (*flexes, prio)}


def test_beside_priority_a_long_flex_prompt_goes_in_short_chunks():
    b, clock = capped(2, blocks=256, budget=512)
    prio = seq(3, tier="priority")
    b.add(prio)
    step(b)
    long_flex = seq(FLEX_CHUNK_BESIDE_PRIORITY * 2 + 5, tier="flex")
    b.add(long_flex)
    assert lengths(step(b)) == {prio.id: 1, long_flex.id: FLEX_CHUNK_BESIDE_PRIORITY}
    assert lengths(step(b)) == {prio.id: 1, long_flex.id: FLEX_CHUNK_BESIDE_PRIORITY}
    b.remove(prio)
    clock[0] += PRIORITY_HOLD_S
    assert lengths(step(b)) == {long_flex.id: 5}  # the cap lifted: the rest at once


def test_with_a_cap_of_zero_flex_waits_until_the_priority_request_ends():
    b, clock = capped(0)
    flex, prio, default = seq(2, tier="flex"), seq(2, tier="priority"), seq(2)
    for s in (flex, prio, default):
        b.add(s)
    assert lengths(step(b)) == {prio.id: 2, default.id: 2}
    assert lengths(step(b)) == {prio.id: 1, default.id: 1} and flex.status is Status.WAITING
    b.remove(prio)
    clock[0] += PRIORITY_HOLD_S / 2
    assert lengths(step(b)) == {default.id: 1}  # held a while after it
    b.remove(default)
    assert lengths(step(b)) == {flex.id: 2}  # nothing else to run: it runs after all
    clock[0] += PRIORITY_HOLD_S
    assert lengths(step(b)) == {flex.id: 1}


def test_a_better_tier_short_of_blocks_preempts_flex():
    b = Batcher(BlockManager(5, 4), max_num_seqs=8, max_num_batched_tokens=64)
    default, flex = seq(7), seq(7, tier="flex")
    for s in (default, flex):
        b.add(s)
    step(b)  # two blocks each, one free
    prio = seq(8, tier="priority")
    b.add(prio)
    out = step(b)
    assert out.preempted == [flex] and lengths(out) == {default.id: 1, prio.id: 8}


def test_a_better_tier_waiting_for_a_slot_held_by_default_requests_preempts_nobody():
    b = Batcher(BlockManager(64, 4), max_num_seqs=1, max_num_batched_tokens=64)
    running = seq(3)
    b.add(running)
    step(b)
    prio = seq(3, tier="priority")
    b.add(prio)
    out = step(b)
    assert out.preempted == [] and lengths(out) == {running.id: 1} and prio.status is Status.WAITING


def test_flex_waiting_behind_running_requests_preempts_nobody():
    b = Batcher(BlockManager(64, 4), max_num_seqs=1, max_num_batched_tokens=64)
    running = seq(3)
    b.add(running)
    step(b)
    b.add(seq(3, tier="flex"))
    assert step(b).preempted == [] and lengths(step(b)) == {running.id: 1}


def test_out_of_blocks_preempts_the_flex_request_before_a_newer_default_one():
    b = Batcher(BlockManager(4, 4), max_num_seqs=4, max_num_batched_tokens=64)
    flex, default = seq(8, tier="flex"), seq(7)
    for s in (flex, default):
        b.add(s)
    step(b)  # all four blocks held; flex's next token needs a fifth
    out = step(b)
    assert out.preempted == [flex] and lengths(out) == {default.id: 1}
