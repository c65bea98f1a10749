"""The fused llama layers (worker/fused_layers.py) against the model's own modules."""
from __future__ import annotations

import pytest
import torch

from tests.unit.test_engine import make_engine, prompts, run
from worker.batcher import Batcher
from worker.block_manager import BlockManager
from worker.engine import Engine
from worker.fused_layers import Weight
from worker import kernels as step_kernels
from worker.model_runner import PagedRunner
from worker.model_loader import load_model
from shared.tokenizer import Tokenizer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_weight_is_prepacked_where_onednn_packs_it(dtype):
    w = torch.randn((96, 64)).to(dtype)
    weight = Weight(w, None, torch.device("cpu"))
    try:
        want = torch.ops.mkldnn._reorder_linear_weight(w, 1)
    except (AttributeError, RuntimeError):
        want = None
    assert (weight.packed is None) == (want is None)


def test_an_fp32_prepacked_weight_computes_the_plain_matmul_to_rounding_at_every_batch_size():
    gen = torch.Generator().manual_seed(1)
    for shape in ((96, 64), (192, 64), (64, 128), (576, 576), (576, 1536)):
        w, b = torch.randn(shape, generator=gen), torch.randn(shape[0], generator=gen)
        weight = Weight(w, b, torch.device("cpu"))
        scale = shape[1] ** 0.5  # the outputs' size: a sum of `in` unit normal products
        for rows in range(1, 41):  # oneDNN picks its kernel by rows: one stream, decodes, chunks
            x = torch.randn((rows, shape[1]), generator=gen)
            torch.testing.assert_close(weight(x), torch.nn.functional.linear(x, w, b), rtol=0, atol=2e-5 * scale,
                                       msg=lambda m: f"{shape}, {rows} rows: {m}")


def test_a_bf16_prepacked_weight_computes_the_plain_matmul():
    w = torch.randn((96, 64)).to(torch.bfloat16)
    x = torch.randn((4, 64)).to(torch.bfloat16)
    torch.testing.assert_close(Weight(w, None, torch.device("cpu"))(x), torch.nn.functional.linear(x, w))


def test_fused_layers_give_the_tokens_of_the_modules_in_bf16(tiny_llama):
    texts = prompts(12, seed=5)
    fused = run(_engine(tiny_llama, fuse=True), texts, arrive_every=2)
    plain = run(_engine(tiny_llama, fuse=False), texts, arrive_every=2)
    assert [s.output_ids for s in fused] == [s.output_ids for s in plain]


def test_the_fused_path_is_the_one_that_runs(tiny_llama):
    assert make_engine(tiny_llama).runner.fused is not None


def _engine(folder, fuse: bool, kernels: bool = False, dtype=torch.bfloat16) -> Engine:
    model = load_model(folder, torch.device("cpu"), dtype)
    runner = PagedRunner(model, torch.device("cpu"), 256, 4, step_kernels.load() if kernels else None)
    if not fuse:
        runner.fused = None  # the modules' own forward, step by step
    return Engine(runner, Tokenizer(folder), Batcher(BlockManager(256, 4, True), 8, 32))
