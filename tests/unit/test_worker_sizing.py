"""The worker sizes its batch from its KV cache (worker/main.py)."""
from shared.settings import WorkerSettings
import torch

from worker.main import FLEX_BESIDE_PRIORITY_ON_CPU, TOKENS_PER_REQUEST, batch_for_cache, flex_beside_priority


def test_the_batch_is_what_the_cache_holds_at_a_chat_turn_a_request():
    settings = WorkerSettings(block_size=16)
    assert settings.batch_size == 128 and settings.max_num_batched_tokens == 2048
    def blocks_for(requests: int) -> int:
        return requests * TOKENS_PER_REQUEST // 16
    assert batch_for_cache(settings.batching, settings.cache, blocks_for(1000)) == 128  # a big cache: the setting
    assert batch_for_cache(settings.batching, settings.cache, blocks_for(40)) == 40  # a small one: what it holds
    assert batch_for_cache(settings.batching, settings.cache, 1) == 1
    assert batch_for_cache(WorkerSettings(batch_size=4).batching, settings.cache, blocks_for(40)) == 4


def test_the_settings_sections_hold_every_worker_field_under_its_flat_environment_name(monkeypatch):
    monkeypatch.setenv("STREAMQ_BLOCK_SIZE", "32")
    monkeypatch.setenv("STREAMQ_BATCH_SIZE", "12")
    monkeypatch.setenv("STREAMQ_NGRAM_MAX", "7")
    monkeypatch.setenv("STREAMQ_VLLM_ENFORCE_EAGER", "true")
    settings = WorkerSettings()
    assert settings.cache.block_size == 32 and settings.batching.batch_size == 12
    assert settings.speculative.ngram_max == 7 and settings.vllm.enforce_eager
    assert settings.speculative.method == settings.speculative_method  # the section's word left out
    sections = [settings.batching, settings.cache, settings.step, settings.speculative, settings.vllm]
    # each section field is a setting (by its alias where the section drops its word), in one section at most
    grouped = [field.alias or name for section in sections for name, field in type(section).model_fields.items()]
    assert len(grouped) == len(set(grouped)) and set(grouped) <= set(WorkerSettings.model_fields)
    for section in sections:
        assert all(getattr(section, name) == getattr(settings, field.alias or name)
                   for name, field in type(section).model_fields.items())


def test_flex_beside_priority_is_capped_on_a_cpu_unless_set():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")  # a device object only: no GPU needed
    assert flex_beside_priority(WorkerSettings().batching, cpu) == FLEX_BESIDE_PRIORITY_ON_CPU
    assert flex_beside_priority(WorkerSettings().batching, gpu) is None
    assert flex_beside_priority(WorkerSettings(flex_beside_priority=0).batching, gpu) == 0
    assert flex_beside_priority(WorkerSettings(flex_beside_priority=128).batching, cpu) == 128
