"""Speculative decoding in the engine, on tiny models: greedy output equals transformers'
token for token with prompt lookup or a draft model, through chunked prefill, preemption and
rejected proposals; seeded sampling emits what plain seeded sampling does."""
from __future__ import annotations

import pytest
import torch

from tests.unit.test_engine import NEW_TOKENS, _check, make_engine, prompts, run
from streamq.testing.tiny_models import build_model
from worker.engine.drafter import DraftProposer
from worker.engine.core import Engine
from worker.model.model_loader import load_model
from worker.engine.speculation import NgramProposer, Speculator

# Prompts that repeat themselves, so lookup has something to propose, mixed with plain ones.
ECHO = ["the capital of France is Paris and the capital of France is Paris and the capital of",
        "once upon a time streams batches caches once upon a time streams batches caches once upon"]


def with_ngram(engine: Engine, k: int = 4, min_n: int = 1) -> Engine:
    engine.speculator = Speculator(NgramProposer(k, min_n=min_n, max_n=3), k)
    return engine


def with_draft(engine: Engine, draft_folder, k: int = 3) -> Engine:
    model = load_model(draft_folder, torch.device("cpu"), torch.float32)
    engine.speculator = Speculator(DraftProposer.beside(engine.runner, model), k)
    return engine


class Oracle:
    """Proposes each request's known future (from a plain run): right for the first `right`
    tokens, wrong after, so steps keep some proposals and roll the others back."""

    def __init__(self, futures: dict[str, list[int]], right: int = 2):
        self.futures, self.right = futures, right

    def propose(self, wanted):
        out = {}
        for seq, k in wanted:
            true = self.futures[seq.id][len(seq.output_ids):len(seq.output_ids) + k]
            if true:
                out[seq.id] = (true[:self.right] + [t + 1 for t in true[self.right:]], None)
        return out

    def forget(self, seq_id):
        pass

    def verified(self, seq):
        pass


@pytest.fixture(params=["llama", "opt"])
def model_dir(request, tiny_llama, tiny_opt):
    return tiny_llama if request.param == "llama" else tiny_opt


@pytest.fixture(scope="session")
def other_llama(tmp_path_factory):
    """Another tiny llama with the same tokenizer and different weights: a draft that is often wrong."""
    return build_model(tmp_path_factory.mktemp("draft-llama"), "llama", seed=1)


def test_lookup_greedy_output_equals_plain_decoding(model_dir):
    engine = with_ngram(make_engine(model_dir, budget=24))
    seqs = run(engine, ECHO + prompts(10, seed=5), arrive_every=2)
    _check(model_dir, seqs)
    assert engine.speculator.stats.proposed > 0


def test_partly_right_proposals_keep_the_output_exact(model_dir):
    texts = ECHO + prompts(8, seed=5)
    plain = run(make_engine(model_dir), texts)
    engine = make_engine(model_dir, budget=24)
    engine.speculator = Speculator(Oracle({s.id: s.output_ids for s in plain}), 4)
    seqs = run(engine, texts, arrive_every=2)
    _check(model_dir, seqs)
    stats = engine.speculator.stats
    assert 0 < stats.accepted < stats.proposed  # some kept, some rolled back
    assert sum(len(s.output_ids) for s in seqs) == len(texts) * NEW_TOKENS


def test_proposals_survive_preemption_and_a_full_cache(model_dir):
    texts = ECHO + prompts(14, seed=1)
    plain = run(make_engine(model_dir), texts)
    engine = make_engine(model_dir, num_blocks=40, block_size=4, batch=8, budget=64)
    engine.speculator = Speculator(Oracle({s.id: s.output_ids for s in plain}), 4)
    seqs = run(engine, texts, arrive_every=1)
    assert engine.batcher.num_preemptions > 0 and engine.speculator.stats.accepted > 0
    _check(model_dir, seqs)
    assert engine.batcher.blocks.num_free == 40  # every block came back, rolled-back ones too


def test_a_draft_model_equal_to_the_target_has_every_proposal_accepted(tiny_llama):
    engine = with_draft(make_engine(tiny_llama), tiny_llama, k=3)
    seqs = run(engine, ECHO + prompts(6, seed=6), arrive_every=2)
    _check(tiny_llama, seqs)
    stats = engine.speculator.stats
    assert stats.proposed > 0 and stats.accepted == stats.proposed


def test_a_wrong_draft_model_changes_nothing_in_the_output(tiny_llama, other_llama):
    engine = with_draft(make_engine(tiny_llama, budget=24), other_llama, k=3)
    seqs = run(engine, ECHO + prompts(8, seed=7), arrive_every=2)
    _check(tiny_llama, seqs)
    stats = engine.speculator.stats
    assert stats.proposed > 0 and stats.accepted < stats.proposed


def test_certain_proposals_keep_plain_seeded_sampling_token_for_token(tiny_llama):
    texts = ECHO + prompts(4, seed=8)
    plain = run(make_engine(tiny_llama), texts, temperature=0.8, seed=11)
    engine = make_engine(tiny_llama)
    engine.speculator = Speculator(Oracle({s.id: s.output_ids for s in plain}), 4)
    spec = run(engine, texts, temperature=0.8, seed=11)
    assert engine.speculator.stats.accepted > 0
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]


def test_draft_sampling_is_reproducible_and_respects_limits(tiny_llama, other_llama):
    def once():
        engine = with_draft(make_engine(tiny_llama), other_llama, k=4)
        return engine, run(engine, ECHO + prompts(3, seed=9), temperature=1.0, top_k=20, seed=3)
    first_engine, first = once()
    _, second = once()
    assert [s.output_ids for s in first] == [s.output_ids for s in second]
    assert first_engine.speculator.stats.proposed > 0
    for s in first:  # several tokens a step, never past max_tokens
        assert len(s.output_ids) <= NEW_TOKENS and (s.finish_reason.value == "stop" or len(s.output_ids) == NEW_TOKENS)


def test_the_worker_builds_the_speculator_its_settings_ask_for(tiny_llama, tmp_path):
    from shared.settings import WorkerSettings
    from streamq.testing.tiny_models import build_tokenizer
    from worker.main import build_engine

    other = build_model(tmp_path / "other", "llama")
    build_tokenizer(other, vocab_size=300)  # the same weights' shape, another vocabulary
    settings = WorkerSettings(model=str(tiny_llama), speculative_method="draft", speculative_model=str(other),
                              num_kv_blocks=64, device="cpu", dtype="float32", metrics_port=-1)
    with pytest.raises(ValueError, match="another tokenizer"):
        build_engine(settings)
    ngram = build_engine(settings.model_copy(update={"speculative_method": "ngram", "num_speculative_tokens": 5}))
    assert isinstance(ngram.speculator.proposer, NgramProposer) and ngram.speculator.max_k == 5
    assert build_engine(settings.model_copy(update={"speculative_method": "off"})).speculator is None
    draft = build_engine(settings.model_copy(update={"speculative_model": str(tiny_llama)}))
    assert isinstance(draft.speculator.proposer, DraftProposer)
    seqs = run(draft, ECHO)
    _check(tiny_llama, seqs)
    assert draft.speculator.stats.accepted == draft.speculator.stats.proposed > 0
