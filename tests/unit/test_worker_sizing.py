"""The worker sizes its batch from its KV cache (worker/main.py)."""
from shared.settings import WorkerSettings
from worker.main import TOKENS_PER_REQUEST, batch_for_cache


def test_the_batch_is_what_the_cache_holds_at_a_chat_turn_a_request():
    settings = WorkerSettings(block_size=16)
    assert settings.batch_size == 128 and settings.max_num_batched_tokens == 2048
    blocks_for = lambda requests: requests * TOKENS_PER_REQUEST // 16  # noqa: E731
    assert batch_for_cache(settings, blocks_for(1000)) == 128  # a big cache: the setting
    assert batch_for_cache(settings, blocks_for(40)) == 40  # a small one: what it holds
    assert batch_for_cache(settings, 1) == 1
    assert batch_for_cache(WorkerSettings(batch_size=4), blocks_for(40)) == 4
