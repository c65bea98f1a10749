"""The shared KV tier through real processes: a takeover after kill -9 fetches what the dead worker
computed and prefills less than a block, with the undisturbed text; a chat's second turn after
the only worker restarted reuses the first turn's blocks."""
from __future__ import annotations


import httpx
import pytest
import torch

from shared.sampling import SamplingParams
from shared.tokenizer import Tokenizer
from tests.stack import Stack, kill_mid_stream
from worker.model import kernels
from worker.engine.batcher import Batcher
from worker.engine.block_manager import BlockManager
from worker.engine.core import Engine
from worker.model.model_loader import load_model
from worker.model.model_runner import PagedRunner

BLOCK = 16  # the workers' default block size
FAST_FAILOVER = {"STREAMQ_HEARTBEAT_INTERVAL_S": "0.25", "STREAMQ_HEARTBEAT_TTL_S": "1",
                 "STREAMQ_RECLAIM_INTERVAL_S": "1"}
PROMPT = " ".join(["the capital of France is Paris and streams batches caches"] * 5)
TOKENS = 120


def undisturbed(folder, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The greedy tokens of one request alone, in this process, on the workers' kernels and dtype
    (the stack runs fp32), with no tier and an empty cache."""
    runner = PagedRunner(load_model(folder, torch.device("cpu"), torch.float32), torch.device("cpu"), 64, BLOCK,
                         kernels.load())
    engine = Engine(runner, Tokenizer(folder), Batcher(BlockManager(64, BLOCK), 8, 2048))
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    [seq] = engine.generate([prompt_ids], params)
    assert runner.batch_invariant or pytest.skip("this CPU's fp32 projections depend on the batch")
    return seq.output_ids


def test_a_takeover_fetches_the_dead_workers_blocks_and_continues_its_text(redis_url, tiny_llama, tmp_path):
    with Stack(redis_url, tiny_llama, tmp_path, workers=2, scheduler=True, env=FAST_FAILOVER) as stack:
        body = {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
        # Held at its 50th token: blocks of the prompt and of the output are in the tier.
        events, _, rid, victim = kill_mid_stream(stack, f"{stack.urls[0]}/v1/requests", body, at_token=50)
        tokens = [e["data"]["token_id"] for e in events if e["event"] == "token"]
        assert [int(e["id"]) for e in events if e["event"] == "token"] == list(range(TOKENS))
        record = stack.record(rid)
    prompt_ids = Tokenizer(tiny_llama).encode(PROMPT)
    assert record.worker != victim and record.attempts >= 1, record
    reused = record.reused_tokens
    # The prompt's blocks and at least one of the dead worker's output blocks (it had delivered 50
    # tokens, maybe more) came from the tier, on a worker that had computed none of them: the
    # continuation prefilled only what was left.
    assert reused % BLOCK == 0 and len(prompt_ids) + BLOCK <= reused < len(prompt_ids) + TOKENS, \
        (reused, len(prompt_ids))
    assert tokens == undisturbed(tiny_llama, prompt_ids, TOKENS)


def test_the_second_turn_of_a_chat_after_a_restart_reuses_the_first(redis_url, tiny_llama, tmp_path):
    with Stack(redis_url, tiny_llama, tmp_path, workers=1) as stack, httpx.Client(timeout=120) as client:
        chat = f"{stack.urls[0]}/v1/chat/completions"
        first = [{"role": "user", "content": PROMPT}]
        turn1 = client.post(chat, json={"model": stack.model_name, "messages": first, "max_tokens": 40,
                                        "temperature": 0}).json()
        assert turn1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing anywhere yet
        stack.kill_worker(stack.worker_name(0))
        stack.start_worker(0, "restarted")  # an empty cache: turn 2 waits in the queue for it
        second = first + [turn1["choices"][0]["message"], {"role": "user", "content": "and Seoul?"}]
        turn2 = client.post(chat, json={"model": stack.model_name, "messages": second, "max_tokens": 8,
                                        "temperature": 0}).json()
    cached = turn2["usage"]["prompt_tokens_details"]["cached_tokens"]
    # Turn 1's prompt (templated) is turn 2's prefix: its full blocks came from the tier.
    assert cached >= (turn1["usage"]["prompt_tokens"] // BLOCK - 1) * BLOCK > 0, (cached, turn1["usage"])
    assert cached < turn2["usage"]["prompt_tokens"]
