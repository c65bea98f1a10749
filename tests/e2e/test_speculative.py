"""Speculative decoding through the whole stack: a worker with prompt lookup streams exactly
plain greedy decoding's tokens, several per step, each with its own index; a request may opt
out; the worker's /metrics count what was proposed and kept. On the default model, greedy
output is the same with and without speculation, and lookup is accepted where text repeats."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from shared.tokenizer import Tokenizer
from tests.e2e.helpers import hf_greedy, token_ids
from tests.e2e.test_worker_metrics import scrape
from tests.stack import Stack, stream_events
from streamq.testing.tiny_models import first_layers

PROMPTS = ["Once upon a time", "a b c d e f g h i j k l m n o p", "Seoul and Paris and Seoul and", "🚀 🚀"]
TOKENS = 40
SPEC_ENV = {"STREAMQ_SPECULATIVE_METHOD": "ngram", "STREAMQ_NGRAM_MIN": "1", "STREAMQ_NUM_SPECULATIVE_TOKENS": "4"}


def test_a_speculating_worker_streams_plain_greedy_tokens(redis_url, tiny_llama, tmp_path):
    tok = Tokenizer(tiny_llama)
    with Stack(redis_url, tiny_llama, tmp_path, env=SPEC_ENV) as stack, httpx.Client(timeout=120) as client:
        api = stack.urls[0]
        [worker] = client.get(f"{api}/readyz").json()["workers"]
        metrics = f"http://127.0.0.1:{worker['metrics_port']}/metrics"

        def stream(prompt: str, **extra) -> list[dict]:
            return stream_events(client, "POST", f"{api}/v1/requests", json={
                "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": True, **extra})

        before = scrape(client, metrics)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(pool.map(stream, PROMPTS))
        during = scrape(client, metrics)
        opted_out = stream(PROMPTS[2], speculative=False)
        after = scrape(client, metrics)

    for prompt, events in zip(PROMPTS, results):
        tokens = [e for e in events if e["event"] == "token"]
        assert [int(e["id"]) for e in tokens] == list(range(TOKENS)), prompt  # every index once, in order
        assert token_ids(events) == hf_greedy(tiny_llama, tok.encode(prompt), TOKENS, ignore_eos=True), prompt
    assert token_ids(opted_out) == token_ids(results[2])

    def delta(name, a, b):
        return b.get((name, ()), 0.0) - a.get((name, ()), 0.0)
    proposed = delta("streamq:spec_decode_num_draft_tokens_total", before, during)
    accepted = delta("streamq:spec_decode_num_accepted_tokens_total", before, during)
    assert proposed > 0 and 0 <= accepted <= proposed
    assert delta("streamq:spec_decode_num_drafts_total", before, during) > 0
    assert delta("streamq:spec_decode_num_draft_tokens_total", during, after) == 0  # the opted-out request
    assert delta("streamq:generation_tokens_total", before, during) == TOKENS * len(PROMPTS)


PASSAGE = ("The harbour town of Ellery sits where the river meets the sea. Every morning the fishing boats go out "
           "before dawn and come back by noon, and the market by the quay sells what they caught: mackerel, "
           "sardines, crabs and, in late summer, tuna. The town has one school, two bakeries, a lighthouse that "
           "still works, and a library that opens on Tuesdays and Saturdays. In winter the storms close the road "
           "over the hills for days at a time, and the ferry to the islands runs only when the harbour master says "
           "it is safe. Visitors come for the cliffs, the birds and the quiet.")


@pytest.mark.slow
def test_default_model_greedy_is_the_same_with_and_without_speculation(tmp_path):
    from shared.model_paths import prepare_model, weights_dir
    from shared.settings import WorkerSettings
    from tests.unit.test_engine import make_engine, run
    from tests.unit.test_speculative_engine import with_draft, with_ngram

    settings = WorkerSettings(_env_file=None, model="default")
    prepare_model(settings)
    folder = weights_dir(settings)
    plain = make_engine(folder, num_blocks=128, block_size=16, batch=4, budget=256)
    asks = [f"Rewrite this passage in the past tense:\n\n{PASSAGE}", f"Fix the spelling in this text:\n\n{PASSAGE}",
            "Name three colours.", "Write one sentence about the sea."]
    chats = [plain.tokenizer.render_chat([{"role": "user", "content": a}]) for a in asks]
    expected = [s.output_ids for s in run(plain, chats, max_tokens=48)]

    lookup = with_ngram(make_engine(folder, num_blocks=128, block_size=16, batch=4, budget=256), k=4, min_n=3)
    assert [s.output_ids for s in run(lookup, chats, max_tokens=48)] == expected
    stats = lookup.speculator.stats
    assert stats.accepted > 0.5 * stats.proposed > 0, stats  # the passage is largely copied

    draft_folder = first_layers(folder, tmp_path / "draft", 8)
    draft = with_draft(make_engine(folder, num_blocks=128, block_size=16, batch=4, budget=256), draft_folder, k=3)
    assert [s.output_ids for s in run(draft, chats, max_tokens=48)] == expected
    assert draft.speculator.stats.proposed > 0
