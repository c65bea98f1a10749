"""The CPU step kernels (worker/model/csrc/step_kernels.cpp) against the eager ops they replace."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from shared.tokenizer import Tokenizer
from tests.unit.test_engine import make_engine, prompts, run
from tests.unit.test_fused_layers import _engine
from worker.model import kernels
from worker.engine.batcher import Batcher
from worker.engine.block_manager import BlockManager
from worker.engine.core import Engine
from worker.model.fused_layers import Weight, _rms_norm, rotate_half
from worker.model.model_loader import load_model
from worker.model.forward_plan import AMX_MATMUL_ROWS
from worker.model.model_runner import PagedRunner

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops():
    built = kernels.load()
    assert built is not None, "the CPU step kernels failed to build (see the log)"
    return built


def _randn(*shape, dtype, gen):
    return torch.randn(shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_adds_in_place_and_normalises_as_the_eager_norm(ops, dtype):
    gen = torch.Generator().manual_seed(0)
    h, y, w = _randn(5, 96, dtype=dtype, gen=gen), _randn(5, 96, dtype=dtype, gen=gen), _randn(96, dtype=dtype, gen=gen)
    want_h = h + y
    out = ops.add_rms_norm(h, y, w, 1e-5)
    assert torch.equal(h, want_h)
    # The sum of squares runs in another order: fp32 within a few ulp, bf16 almost always equal.
    torch.testing.assert_close(out, _rms_norm(want_h, w, 1e-5), rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-6)
    alone = ops.add_rms_norm(want_h.clone(), None, w, 1e-5)
    assert torch.equal(alone, out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_cache_rotates_like_transformers_and_writes_each_slot(ops, dtype):
    gen = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, dim, slots_total = 6, 4, 2, 16, 40
    qkv = _randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, gen=gen)
    cos, sin = _randn(tokens, dim, dtype=dtype, gen=gen), _randn(tokens, dim, dtype=dtype, gen=gen)
    k_cache = torch.zeros((kv_heads, slots_total, dim), dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 9, 1, 30, 31, 0])
    q = ops.rope_cache(qkv, cos, sin, slots, k_cache, v_cache, heads, kv_heads)
    q_in, k_in, v_in = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    c, s = cos[:, None], sin[:, None]
    q_in, k_in = q_in.view(tokens, heads, dim), k_in.view(tokens, kv_heads, dim)
    assert torch.equal(q, q_in * c + rotate_half(q_in) * s)  # bit for bit, the eager roundings
    assert torch.equal(k_cache[:, slots].transpose(0, 1), k_in * c + rotate_half(k_in) * s)
    assert torch.equal(v_cache[:, slots].transpose(0, 1), v_in.view(tokens, kv_heads, dim))
    untouched = torch.ones(slots_total, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[:, untouched].any() and not v_cache[:, untouched].any()


@pytest.mark.parametrize("window", [0, 6])  # 0: the whole context; 6: the last 6 keys (sliding-window layers)
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_reads_each_tokens_own_blocks_up_to_its_position(ops, dtype, window):
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, blocks, block = 6, 2, 16, 20, 4
    k_cache = _randn(kv_heads, blocks, block, dim, dtype=dtype, gen=gen)
    v_cache = _randn(kv_heads, blocks, block, dim, dtype=dtype, gen=gen)
    tables = torch.tensor([[5, 2, 7, 9, 11], [1, 3, 4, 0, 0]])
    q = _randn(6, heads, dim, dtype=dtype, gen=gen)
    out = torch.zeros_like(q)
    tokens, rows, context = torch.tensor([0, 2, 3, 5]), torch.tensor([0, 1, 1, 0]), torch.tensor([17, 9, 1, 20])
    ops.paged_attention(q, out, tokens, rows, context, tables, k_cache, v_cache, 0.25, window)
    for t, r, n in zip(tokens.tolist(), rows.tolist(), context.tolist()):
        first = max(0, n - window) if window else 0
        keys = k_cache[:, tables[r]].reshape(kv_heads, -1, dim)[:, first:n].float()
        values = v_cache[:, tables[r]].reshape(kv_heads, -1, dim)[:, first:n].float()
        query = q[t].float().view(kv_heads, heads // kv_heads, dim)  # the heads of one kv head are adjacent
        want = (torch.softmax(query @ keys.transpose(-1, -2) * 0.25, -1) @ values).reshape(heads, dim)
        torch.testing.assert_close(out[t].float(), want, rtol=1e-5 if dtype == torch.float32 else 1e-2,
                                   atol=1e-5 if dtype == torch.float32 else 1e-2)
    assert not out[[1, 4]].any()  # tokens not listed are left alone


@pytest.mark.parametrize("dim", [16, 20])  # 20: a head dimension that is not a multiple of 16 lanes
@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_gives_a_token_the_same_bits_alone_or_in_any_chunk(ops, dtype, window, dim):
    """A token attended alone (a decode), in a prefill chunk of any length starting anywhere (a
    cached prefix, a chunked prefill, a failover's replay), or among other sequences' tokens gets
    the same bits: the kernel's sums for a token do not depend on what it shares the call with."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, blocks, block, length = 6, 2, 40, 4, 70
    k_cache = _randn(kv_heads, blocks, block, dim, dtype=dtype, gen=gen)
    v_cache = _randn(kv_heads, blocks, block, dim, dtype=dtype, gen=gen)
    tables = torch.tensor([list(range(20, 38)), [3, 9, 1, 0] + [0] * 14])
    q = _randn(length, heads, dim, dtype=dtype, gen=gen)

    def attend(positions: list[int], other: int = 0) -> torch.Tensor:
        """Tokens at `positions` of sequence 0 (q row = position), after `other` tokens of sequence 1."""
        out = torch.zeros_like(q)
        theirs = list(range(other))
        tokens = torch.tensor(theirs + positions)
        rows = torch.tensor([1] * other + [0] * len(positions))
        context = torch.tensor([p + 1 for p in theirs] + [p + 1 for p in positions])
        ops.paged_attention(q, out, tokens, rows, context, tables, k_cache, v_cache, 0.3, window)
        return out

    alone = torch.stack([attend([p])[p] for p in range(length)])
    keys = k_cache[:, tables[0]].reshape(kv_heads, -1, dim).double()
    values = v_cache[:, tables[0]].reshape(kv_heads, -1, dim).double()
    for p in range(length):  # and right: softmax(q k / sqrt) v over the token's own keys, in float64
        first = max(0, p + 1 - window) if window else 0
        query = q[p].double().view(kv_heads, heads // kv_heads, dim)
        weights = torch.softmax(query @ keys[:, first:p + 1].transpose(-1, -2) * 0.3, -1)
        want = (weights @ values[:, first:p + 1]).reshape(heads, dim)
        torch.testing.assert_close(alone[p].double(), want, rtol=1e-5 if dtype == torch.float32 else 1e-2,
                                   atol=1e-5 if dtype == torch.float32 else 1e-2)
    for start, end in [(0, length), (0, 33), (13, 70), (31, 32), (40, 57)]:
        chunk = attend(list(range(start, end)))
        assert torch.equal(chunk[start:end], alone[start:end]), (start, end)
    mixed = attend(list(range(20, 45)), other=9)  # after another sequence's tokens in the same call
    assert torch.equal(mixed[20:45], alone[20:45])


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_gives_the_same_bits_on_every_isa(ops, dtype):
    """The portable loops, AVX2's and AVX-512's intrinsics (those this CPU runs) give each token the
    same bits: a request taken over by a worker on another CPU goes on with the same numbers. Head
    sizes that fill the 16 lanes and one that does not; whole contexts, sliding windows, and tokens
    that see keys past their position (Gemma 3's images)."""
    isas = ["portable", *(isa for isa in ops.isas if isa != "avx512vnni")]
    gen = torch.Generator().manual_seed(11)
    for dim, heads, kv_heads, window, seen_past in [(64, 14, 2, 0, False), (20, 6, 3, 7, False), (128, 8, 2, 0, True),
                                                     (16, 4, 4, 33, True)]:
        blocks, block = 48, 16
        k_cache = _randn(kv_heads, blocks, block, dim, dtype=dtype, gen=gen)
        v_cache = _randn(kv_heads, blocks, block, dim, dtype=dtype, gen=gen)
        tables = torch.stack([torch.randperm(blocks, generator=gen)[:16] for _ in range(3)])
        rows = [0] * 90 + [1] + [2] * 21  # a prefill chunk from position 7, a decode, a chunk from 200
        context = list(range(8, 98)) + [170] + list(range(201, 222))
        positions = torch.tensor([c - 1 - (5 if seen_past and i % 4 == 0 else 0) for i, c in enumerate(context)])
        q = _randn(len(rows), heads, dim, dtype=dtype, gen=gen)
        outs = {}
        for isa in isas:
            out = torch.zeros_like(q)
            ops.paged_attention(q, out, torch.arange(len(rows)), torch.tensor(rows), torch.tensor(context), tables,
                                k_cache, v_cache, dim ** -0.5, window, positions if seen_past else None, isa=isa)
            outs[isa] = out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
        assert outs["portable"].any()
        for isa in isas[1:]:
            assert torch.equal(outs[isa], outs["portable"]), (isa, dim, window)
    with pytest.raises(RuntimeError, match="isa 'avx9'"):
        ops.paged_attention(q, torch.zeros_like(q), torch.arange(2), torch.tensor([0, 0]), torch.tensor([1, 2]),
                            tables, k_cache, v_cache, 0.5, 0, None, isa="avx9")


def test_the_kernels_give_transformers_tokens_in_fp32(tiny_llama):
    texts = prompts(12, seed=7)
    with_kernels = run(_engine(tiny_llama, fuse=True, kernels=True, dtype=torch.float32), texts, arrive_every=2)
    eager = run(_engine(tiny_llama, fuse=True, kernels=False, dtype=torch.float32), texts, arrive_every=2)
    assert [s.output_ids for s in with_kernels] == [s.output_ids for s in eager]


def test_the_kernels_are_the_path_the_tests_run(tiny_llama):
    assert make_engine(tiny_llama).runner.kernels is not None


def test_a_build_lock_left_by_a_killed_worker_does_not_hold_the_next_one(tmp_path, monkeypatch):
    """torch's build lock is a plain file; a worker killed while compiling left it, and the next
    one waited for it forever. It is removed under a lock that dies with its holder."""
    from torch.utils import cpp_extension

    stale = tmp_path / kernels.build_name() / "lock"
    stale.parent.mkdir(parents=True)
    stale.write_text("")
    seen = []

    def build(**kwargs):
        seen.append((Path(kwargs["build_directory"]) / "lock").exists())
        return "module"

    monkeypatch.setattr(cpp_extension, "load", build)
    assert kernels.load_from.__wrapped__(tmp_path) == "module"
    assert seen == [False]


def test_each_environment_builds_in_its_own_folder(monkeypatch):
    """torch rebuilds a folder whose include paths changed: two venvs sharing one folder rebuilt
    each other's kernels, a minute each time."""
    here = kernels.build_name()
    monkeypatch.setattr(sys, "prefix", "/elsewhere/.venv")
    assert kernels.build_name() != here


def test_a_failed_build_leaves_the_eager_path_with_a_log_line(tmp_path, monkeypatch, caplog, tiny_llama):
    from torch.utils import cpp_extension

    def broken(**_):
        raise RuntimeError("Error building extension: g++ not found")

    monkeypatch.setattr(cpp_extension, "load", broken)
    with caplog.at_level(logging.WARNING, logger="worker.model.kernels"):
        assert kernels.load_from(tmp_path) is None
    assert "eager path serves" in caplog.text and "g++ not found" in caplog.text
    engine = _engine(tiny_llama, fuse=True, kernels=False, dtype=torch.float32)
    assert engine.runner.kernels is None and run(engine, prompts(2))[0].output_ids


@pytest.mark.parametrize("dtype", DTYPES)
def test_panel_linear_is_the_matmul_to_rounding_at_every_row_count(ops, dtype):
    if str(dtype).removeprefix("torch.") not in ops.panel_dtypes:
        pytest.skip(f"this CPU has no panel_linear for {dtype}: its projections use oneDNN's prepacked weights")
    gen = torch.Generator().manual_seed(4)
    # 37 and 70 rows of w: a partial last panel (of 32 columns); 1 to 40 rows of x: every block
    # of up to 12 rows, whole and partial; 2048: a prefill chunk; 81: an odd K (a lone bf16 k).
    for n, inner in [(37, 64), (70, 81), (96, 576), (64, 1536)]:
        w, b = _randn(n, inner, dtype=dtype, gen=gen), _randn(n, dtype=dtype, gen=gen)
        panels = ops.pack_panels(w)
        for rows in [*range(1, 41), 2048]:
            x = _randn(rows, inner, dtype=dtype, gen=gen)
            for bias in (b, None):
                # fp32: within a few ulps of the sum's size; bf16: the fp32 sum rounded once, so
                # within one bf16 ulp of the fp32 reference.
                want = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
                got = ops.panel_linear(x, panels, n, bias)
                assert got.dtype == dtype
                tolerance = dict(rtol=0, atol=2e-5 * inner ** 0.5) if dtype == torch.float32 else \
                    dict(rtol=2 ** -7, atol=1e-3 * inner ** 0.5)
                torch.testing.assert_close(got.float(), want, **tolerance,
                                           msg=lambda m, n=n, inner=inner, rows=rows: f"{n}x{inner}, {rows} rows: {m}")


def test_panel_linear_refuses_panels_of_another_weight(ops):
    if "float32" not in ops.panel_dtypes:
        pytest.skip("this CPU has no AVX-512")
    panels = ops.pack_panels(torch.randn(40, 64))
    with pytest.raises(RuntimeError, match="pack_panels"):
        ops.panel_linear(torch.randn(2, 64), panels, 70, None)  # 70 rows need 3 panels, not 2
    with pytest.raises(RuntimeError, match="pack_panels"):
        ops.panel_linear(torch.randn(2, 32), panels, 40, None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_runner_computes_its_projections_on_panels_where_the_cpu_has_them(ops, tiny_llama, dtype):
    runner = _engine(tiny_llama, fuse=True, kernels=True, dtype=dtype).runner
    weights = [w for layer in runner.fused for w in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [runner.lm_head]
    if str(dtype).removeprefix("torch.") in ops.panel_dtypes:
        # a oneDNN copy too only where calls of many rows go there (bf16 on a CPU with AMX)
        assert all(w.panels is not None and (w.packed is None) == (w.matmul_rows == 0) for w in weights)
    else:
        assert all(w.panels is None for w in weights)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_one_token_layer_stack_computes_what_the_per_layer_calls_do(tiny_llama, dtype):
    """A one-token step runs every layer in one kernel call; its logits are the per-layer path's."""
    logits = []
    for one_call in (True, False):
        engine = _engine(tiny_llama, fuse=True, kernels=True, dtype=dtype)
        if not one_call:
            engine.runner.one_token = None
        seen = []
        execute = engine.runner.execute
        engine.runner.execute = lambda out, seen=seen, execute=execute, **kw: seen.append(execute(out, **kw)) or seen[-1]
        run(engine, prompts(1, seed=3))  # one request alone: its decode steps are one token each
        logits.append(torch.cat(seen[1:]))  # past the prefill
    assert logits[0].shape[0] > 1 and torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_weight_on_panels_runs_calls_of_matmul_rows_or_more_on_onednn(ops, dtype):
    """As on a CPU with AMX (forced here on any CPU with panels for the dtype): calls of fewer
    rows on panel_linear, more on oneDNN's prepacked matmul; built for deterministic mode, every
    call goes to the panels, which compute each row alone."""
    if str(dtype).removeprefix("torch.") not in ops.panel_dtypes:
        pytest.skip(f"this CPU has no panel_linear for {dtype}")
    gen = torch.Generator().manual_seed(15)
    w, b = _randn(96, 64, dtype=dtype, gen=gen), _randn(96, dtype=dtype, gen=gen)
    weight = Weight(w, b, torch.device("cpu"), ops, matmul_rows=5)
    assert weight.matmul_rows == 5 and weight.packed is not None and not weight.row_independent
    x = _randn(7, 64, dtype=dtype, gen=gen)
    for rows in range(1, 8):
        panels = ops.panel_linear(x[:rows], weight.panels, 96, b)
        onednn = torch.ops.mkldnn._linear_pointwise(x[:rows], weight.packed, b, "none", [], "")
        assert torch.equal(weight(x[:rows]), panels if rows < 5 else onednn), rows
    # Deterministic mode's plan: matmul_rows 0 and a tile, which a weight on panels does not need.
    exact = Weight(w, b, torch.device("cpu"), ops, matmul_rows=0, tile=16)
    assert exact.row_independent and exact.packed is None and exact.tile == 0
    assert torch.equal(exact(x), ops.panel_linear(x, exact.panels, 96, b))


def test_bf16_projections_go_to_onednn_from_five_rows_on_amx_only_and_never_in_deterministic_mode(tiny_llama):
    model = load_model(tiny_llama, torch.device("cpu"), torch.bfloat16)
    runner = PagedRunner(model, torch.device("cpu"), 64, 4, kernels.load())
    has_panels = "bfloat16" in kernels.load().panel_dtypes
    want = AMX_MATMUL_ROWS if kernels.cpu_has("amx_bf16") and has_panels else 0
    assert {w.matmul_rows for layer in runner.fused for w in (layer.qkv, layer.o, layer.gate_up, layer.down)} == {want}
    assert runner.lm_head.matmul_rows == want
    model = load_model(tiny_llama, torch.device("cpu"), torch.bfloat16)
    exact = PagedRunner(model, torch.device("cpu"), 64, 4, kernels.load(), deterministic=True)
    assert exact.lm_head.matmul_rows == 0 and all(layer.qkv.matmul_rows == 0 for layer in exact.fused)


def test_projections_split_between_panels_and_onednn_give_transformers_tokens_in_fp32(tiny_llama):
    """The split forced on any CPU, in fp32 where greedy tokens are transformers' own: decode
    steps of up to 4 rows on panels, the rest and the prefills on oneDNN."""
    texts = prompts(12, seed=7)
    model = load_model(tiny_llama, torch.device("cpu"), torch.float32)
    runner = PagedRunner(model, torch.device("cpu"), 256, 4, kernels.load(), matmul_rows=5)
    assert runner.lm_head.matmul_rows == (5 if "float32" in kernels.load().panel_dtypes else 0)
    split = run(Engine(runner, Tokenizer(tiny_llama), Batcher(BlockManager(256, 4, True), 8, 32)), texts, arrive_every=2)
    eager = run(_engine(tiny_llama, fuse=True, kernels=False, dtype=torch.float32), texts, arrive_every=2)
    assert [s.output_ids for s in split] == [s.output_ids for s in eager]
