"""The decode step that CUDA graphs replay (worker/model/cuda_graphs.py), run on a CPU without capture:
its padding to a batch bucket, the scratch cache block, and attention over a context bucket
masked per request. tests/gpu/test_cuda.py replays the captured graphs on a GPU."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from shared.tokenizer import Tokenizer
from tests.unit.test_engine import NEW_TOKENS, prompts, reference, run
from worker.engine.batcher import Batcher
from worker.model.batch import Chunk, SchedulerOutput
from worker.engine.block_manager import BlockManager
from worker.model.cuda_graphs import batch_buckets, block_buckets
from worker.engine.core import Engine
from worker.model.model_runner import PagedRunner
from worker.model.model_loader import load_model

BLOCKS, BLOCK_SIZE = 256, 4


def _engine(folder, graph_batch: int, batch: int = 8, budget: int = 32) -> Engine:
    model = load_model(folder, torch.device("cpu"), torch.float32)
    runner = PagedRunner(model, torch.device("cpu"), BLOCKS, BLOCK_SIZE, None, graph_batch)
    return Engine(runner, Tokenizer(folder), Batcher(BlockManager(BLOCKS, BLOCK_SIZE, True), batch, budget))


def test_buckets_cover_every_batch_and_context_up_to_the_largest():
    assert batch_buckets(128) == [1, 2, 4, 8] + list(range(16, 129, 16))
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(1) == [1]
    assert block_buckets(512) == [4, 8, 16, 32, 64, 128, 256, 512]
    assert block_buckets(100) == [4, 8, 16, 32, 64, 100]
    assert block_buckets(3) == [3]


def test_decodes_through_the_static_buffers_give_transformers_tokens_in_fp32(tiny_llama):
    texts = prompts(11, seed=3)
    engine = _engine(tiny_llama, graph_batch=8)
    seqs = run(engine, texts, arrive_every=2)
    graphs = engine.runner.graphs
    assert graphs is not None and not graphs.capture
    # Arrivals every other step: batches of every size from 1 to 8, padded to 1, 2, 4 and 8.
    assert graphs.steps > NEW_TOKENS
    plain = run(_engine(tiny_llama, graph_batch=0), texts, arrive_every=2)
    assert [s.output_ids for s in seqs] == [s.output_ids for s in plain]
    for seq in seqs:
        assert seq.output_ids == reference(str(tiny_llama), tuple(seq.prompt_ids))


def _chunk(start: int, length: int, table: list[int], draft: tuple[int, ...] = ()) -> Chunk:
    """A chunk of a request whose known tokens end at start + length - len(draft): it samples."""
    known = [5 + i % 7 for i in range(start + length - len(draft))]
    seq = SimpleNamespace(token_ids=known, num_tokens=len(known))
    return Chunk(seq, start, known[start:] + list(draft), table, 1 + len(draft), list(draft))


def test_padding_rows_write_only_the_scratch_block(tiny_llama):
    runner = _engine(tiny_llama, graph_batch=8).runner
    assert runner.k_cache.shape[2] == BLOCKS + 1  # the scratch block, past the manager's blocks
    chunks = [_chunk(6, 1, [3, 9]), _chunk(0, 1, [7]), _chunk(9, 1, [1, 2, 4])]
    before_k, before_v = runner.k_cache.clone(), runner.v_cache.clone()
    logits = runner.execute(SchedulerOutput(chunks=chunks))  # three rows, padded to a batch of 4
    assert logits.shape[0] == 3 and torch.isfinite(logits).all()
    assert runner.graphs.steps == 1
    written = {(9, 2), (7, 0), (4, 1)}  # (block, offset) of positions 6, 0 and 9 through the tables
    for cache, before in ((runner.k_cache, before_k), (runner.v_cache, before_v)):
        changed = (cache != before).any(dim=-1).any(dim=0).any(dim=0).nonzero().tolist()
        assert {tuple(x) for x in changed} == written | {(BLOCKS, 0)}


def test_a_step_with_a_prefill_chunk_or_a_verify_runs_eagerly(tiny_llama):
    graphs = _engine(tiny_llama, graph_batch=8).runner.graphs
    decode = _chunk(4, 1, [3, 8])
    assert not graphs.fits(SchedulerOutput(chunks=[_chunk(0, 3, [2]), decode]))
    assert not graphs.fits(SchedulerOutput(chunks=[_chunk(4, 2, [3, 8], draft=(9,))]))
    assert not graphs.fits(SchedulerOutput(chunks=[decode] * 9))  # past the largest bucket
    assert graphs.fits(SchedulerOutput(chunks=[decode] * 8))
