import pytest

from worker.engine.block_manager import BlockManager, NoFreeBlocks, block_hash


def test_blocks_are_allocated_and_freed():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate_prefix("a", list(range(6)))
    bm.append_slots("a", 6)
    assert len(bm.table("a")) == 2 and bm.num_free == 2
    bm.append_slots("a", 8)  # still fits in two blocks
    assert len(bm.table("a")) == 2
    bm.append_slots("a", 9)
    assert len(bm.table("a")) == 3 and bm.num_free == 1
    bm.free("a")
    assert bm.num_free == 4 and bm.table("a") == []


def test_running_out_of_blocks_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.append_slots("a", 5)
    with pytest.raises(NoFreeBlocks):
        bm.append_slots("b", 5)
    assert bm.table("b") == [] and bm.num_free == 0


def test_a_shared_prefix_is_computed_once_and_reference_counted():
    bm = BlockManager(num_blocks=8, block_size=4)
    system = list(range(100, 112))  # three full blocks
    a = system + [1, 2]
    assert bm.allocate_prefix("a", a) == 0
    bm.append_slots("a", len(a))
    bm.register("a", a, num_computed=len(a))
    b = system + [7, 8, 9]
    assert bm.allocate_prefix("b", b) == 12
    assert bm.table("b") == bm.table("a")[:3]
    assert [bm.blocks[i].ref_count for i in bm.table("a")] == [2, 2, 2, 1]
    bm.free("a")
    assert [bm.blocks[i].ref_count for i in bm.table("b")] == [1, 1, 1]
    assert bm.prefix_hits == 3


def test_the_last_prompt_token_is_always_computed():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = list(range(8))
    bm.append_slots("a", 8)
    bm.register("a", a, 8)
    # Same 8 tokens: only the first block may come from the cache, the second holds the last token.
    assert bm.allocate_prefix("b", a) == 4


def test_a_different_earlier_block_breaks_the_chain():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = [1, 2, 3, 4, 5]
    bm.append_slots("a", 5)
    bm.register("a", a, 5)
    assert bm.allocate_prefix("b", [9, 9, 3, 4, 5]) == 0  # block [3, 4] is the same, its parent is not


def test_freed_cached_blocks_are_found_again_until_evicted_lru():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = [1, 2, 3, 4, 5]
    bm.append_slots("a", 5)
    bm.register("a", a, 5)
    bm.free("a")
    assert bm.num_free == 3
    assert bm.allocate_prefix("b", a) == 4  # both full blocks come back from the free list
    bm.free("b")
    # Now fill the cache with something else: the least recently freed blocks go first.
    bm.append_slots("c", 2)
    bm.free("c")
    bm.append_slots("d", 6)
    assert bm.allocate_prefix("e", a) == 0


def test_prefix_caching_can_be_off():
    bm = BlockManager(num_blocks=4, block_size=2, prefix_caching=False)
    bm.append_slots("a", 4)
    bm.register("a", [1, 2, 3, 4], 4)
    assert bm.allocate_prefix("b", [1, 2, 3, 4, 5]) == 0


def test_bad_sizes_name_the_values():
    with pytest.raises(ValueError, match="num_blocks=0"):
        BlockManager(0, 16)


def test_the_hash_of_a_block_is_the_same_in_every_process():
    # Python's hash() of the same tuple differs between builds; the shared tier needs one key.
    assert block_hash(None, (1, 2, 3, 4)) == 0x91D16FA893D39DA42EDF81E86F5CA30C  # blake2b: fixed for good
    assert block_hash(None, (1, 2, 3, 4)) != block_hash(block_hash(None, (1, 2, 3, 4)), (1, 2, 3, 4))


def test_blocks_filled_here_are_listed_once_and_blocks_from_elsewhere_are_not():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = [1, 2, 3, 4, 5]
    bm.append_slots("a", 5)
    bm.register("a", a, 5)
    assert [b.key[1] for b in bm.take_filled()] == [(1, 2), (3, 4)]
    assert bm.take_filled() == []
    missing = bm.missing_prefix([1, 2, 3, 4, 6, 7, 8])  # two cached blocks, then (6, 7) missing
    assert [(link.parent, link.tokens) for link in missing] == [(bm.blocks[bm.table("a")[1]].hash, (6, 7))]
    adopted = bm.adopt(missing[0])
    assert bm.take_filled() == []  # computed elsewhere: not offloaded again
    bm.free("a")
    assert bm.allocate_prefix("b", [1, 2, 3, 4, 6, 7, 8]) == 6 and bm.table("b")[2] == adopted


def test_adopting_evicts_the_least_recently_freed_block_and_not_the_prefix_in_use():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.append_slots("a", 4)
    bm.register("a", [1, 2, 3, 4], 4)
    bm.free("a")  # both cached blocks free, at the front of the free list
    missing = bm.missing_prefix([1, 2, 3, 4, 5, 6, 7])  # moves the cached two to the recent end
    assert [link.tokens for link in missing] == [(5, 6)]
    bm.adopt(missing[0])  # takes the third block, never yet used
    assert bm.allocate_prefix("b", [1, 2, 3, 4, 5, 6, 7]) == 6
