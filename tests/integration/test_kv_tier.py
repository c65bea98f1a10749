"""The shared KV tier against a real Redis: engines in-process on the tiny llama model, each with
its own cache, meeting only through Redis, as two workers do."""
from __future__ import annotations

import socket

import redis
import torch

from shared import redis_keys
from shared.messages import RequestPayload, TokenEvent
from shared.redis_client import connect_blocking
from shared.sampling import SamplingParams
from shared.tokenizer import Tokenizer
from worker.model import kernels
from worker.engine.batcher import Batcher
from worker.engine.block_manager import BlockManager
from worker.engine.core import Engine
from worker.engine.kv_tier import KVTier, pack, unpack
from worker.model.model_loader import load_model
from worker.model.model_runner import PagedRunner

BLOCK = 4
PROMPT = ("the capital of France is Paris and the capital of Korea is Seoul; once upon a time a stream "
          "of batches went through the caches")


def engine(folder, url: str, prefix: str, budget_bytes: int = 1 << 30, num_blocks: int = 128) -> Engine:
    model = load_model(folder, torch.device("cpu"), torch.float32)
    runner = PagedRunner(model, torch.device("cpu"), num_blocks, BLOCK, kernels.load())
    tier = KVTier(connect_blocking(url, 1.0), prefix, "space", runner.block_kv_bytes, budget_bytes, 600,
                  trim_every_s=0)  # at every write: the tests count what is left
    return Engine(runner, Tokenizer(folder), Batcher(BlockManager(num_blocks, BLOCK), 8, 64), tier=tier)


def request(tokenizer: Tokenizer, rid: str, text: str = PROMPT, max_tokens: int = 12) -> RequestPayload:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return RequestPayload(id=rid, model="m", prompt_token_ids=tokenizer.encode(text), params=params)


def run(engine: Engine, payload: RequestPayload, resumed=(), steps: int | None = None):
    seq = engine.add(payload, list(resumed))
    done = 0
    while engine.has_work() and (steps is None or done < steps):
        engine.step()
        done += 1
    engine.tier.flush()
    return seq


def test_a_prefix_computed_by_one_engine_is_fetched_by_another_with_the_same_tokens(tiny_llama, redis_url, prefix):
    first, second = engine(tiny_llama, redis_url, prefix), engine(tiny_llama, redis_url, prefix)
    a = run(first, request(first.tokenizer, "a"))
    assert first.tier.counts.offloaded > 0 and first.tier.counts.hits == 0

    b = run(second, request(second.tokenizer, "b"))
    blocks = (len(a.prompt_ids) - 1) // BLOCK  # the prompt's full blocks but the one with its last token
    assert second.tier.counts.hits == blocks
    assert second.batcher.blocks.prefix_hits == blocks  # admitted with them: only the rest was computed
    assert b.output_ids == a.output_ids


def test_a_takeover_fetches_what_the_dead_engine_computed_and_continues_its_text(tiny_llama, redis_url, prefix):
    tokenizer = Tokenizer(tiny_llama)
    undisturbed = run(engine(tiny_llama, redis_url, f"{prefix}-alone"), request(tokenizer, "u"))
    dead = engine(tiny_llama, redis_url, prefix)
    payload = request(tokenizer, "r")
    cut = run(dead, payload, steps=8)  # its prefill and some tokens, then "killed"
    delivered = [TokenEvent(index=i, token_id=t, text="") for i, t in enumerate(cut.output_ids)]
    assert 0 < len(delivered) < 12

    taker = engine(tiny_llama, redis_url, prefix)
    resumed = run(taker, payload, delivered)
    known = len(payload.prompt_token_ids) + len(delivered)
    assert taker.tier.counts.hits == (known - 1) // BLOCK  # generated tokens' blocks too: prefilled < 1 block
    assert resumed.output_ids == undisturbed.output_ids


def test_a_tier_that_is_down_costs_a_miss_not_a_request(tiny_llama, redis_url, prefix):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens there once the socket is closed
    tokenizer = Tokenizer(tiny_llama)
    reference = run(engine(tiny_llama, redis_url, f"{prefix}-ok"), request(tokenizer, "ok"))
    broken = engine(tiny_llama, f"redis://127.0.0.1:{closed}/0", prefix)
    seq = run(broken, request(tokenizer, "x"))
    assert seq.output_ids == reference.output_ids and seq.error is None
    counts = broken.tier.counts
    assert counts.errors >= 1 and counts.hits == 0 and counts.offloaded == 0 and counts.dropped > 0


def test_the_tier_keeps_its_byte_budget_least_recently_used_first(tiny_llama, redis_url, prefix):
    runner_bytes = engine(tiny_llama, redis_url, prefix).runner.block_kv_bytes
    small = engine(tiny_llama, redis_url, prefix, budget_bytes=5 * runner_bytes)
    client = redis.Redis.from_url(redis_url)
    for i, text in enumerate(["one two three " * 8, "four five six " * 8]):
        run(small, request(small.tokenizer, f"r{i}", text))
    run(small, request(small.tokenizer, "last", "seven eight nine " * 8))
    lru = redis_keys.kv_blocks_lru(prefix, "space")
    kept = [key.decode() for key in client.zrange(lru, 0, -1)]
    assert len(kept) == 5 and all(client.exists(key) for key in kept)
    assert len(client.keys(f"{prefix}:kv:space:*")) == 5 + 1  # the blocks and the index: the rest evicted
    first = request(small.tokenizer, "again", "one two three " * 8).prompt_token_ids
    oldest = [small.tier.key(link) for link in BlockManager(64, BLOCK).missing_prefix(first)]
    assert not set(oldest) & set(kept)  # the least recently used went first


def test_a_stored_block_is_used_only_for_its_own_tokens():
    kv = bytes(range(32))
    value = pack(7, [1, 2, 3, 4], kv)
    assert bytes(unpack(value, 7, [1, 2, 3, 4], len(kv))) == kv
    assert unpack(value, 8, [1, 2, 3, 4], len(kv)) is None  # another parent
    assert unpack(value, None, [1, 2, 3, 4], len(kv)) is None
    assert unpack(value, 7, [1, 2, 3, 5], len(kv)) is None  # other tokens
    assert unpack(value[:-1], 7, [1, 2, 3, 4], len(kv)) is None  # cut short
    assert unpack(None, 7, [1, 2, 3, 4], len(kv)) is None

