"""GGUF weights kept quantized: every block type decodes to exactly what gguf's own dequantizer
gives; tiny llama and qwen2 files written here, and the default model, load under transformers'
names with transformers' values; concat_rows stacks weights of mixed formats exactly."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from worker.model.gguf_blocks import TensorReader, UnsupportedTensorType, decode_blocks, read_tensor
from worker.model.gguf_weights import build_model, load_gguf
from worker.model.quantized import QuantizedWeight, concat_rows
from worker.model.quantized import quantize as compress

QUANTIZABLE = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]  # gguf-py quantizes these
# Types gguf-py cannot quantize get random blocks; the byte offsets of their fp16 fields (d, dmin).
FP16_FIELDS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q2_K: (80, 82)}
K_TYPES = [T.Q4_K, T.Q5_K, T.Q6_K]
FLOATS = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}  # kept in their dtype


def random_blocks(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random but valid raw blocks [rows, bytes]: random codes and scales, sane fp16 factors."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        factors = rng.uniform(-0.02, 0.02, (raw.shape[0], 1)).astype(np.float16)
        raw[:, at:at + 2] = factors.view(np.uint8)
    return raw.reshape(rows, -1)


def raw_tensor(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    if qtype in FP16_FIELDS:
        return random_blocks(qtype, rows, cols, seed)
    w = np.random.default_rng(seed).normal(0, 0.05, (rows, cols)).astype(np.float32)
    return quantize(w, qtype)


def write_gguf(path, tensors: dict[str, tuple[T, np.ndarray]], arch: str = "llama", **metadata) -> None:
    """A GGUF file of raw `tensors` {name: (type, data)}; metadata through GGUFWriter's add_<key>."""
    writer = GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        getattr(writer, f"add_{key}")(value)
    for name, (qtype, data) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def exactly_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, element by element. Bitwise but for the sign of zero: Q4_0's codes 0..15 with
    an offset of 8 d give +0 where gguf's d * (code - 8) gives -0 (for a negative d)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("qtype", QUANTIZABLE + K_TYPES + list(FLOATS), ids=lambda t: t.name)
def test_each_type_reads_back_as_gguf_dequantizes_it(tmp_path, qtype):
    raw = raw_tensor(qtype, 24, 512)
    write_gguf(tmp_path / "t.gguf", {"w": (qtype, raw)})
    tensor = TensorReader(tmp_path / "t.gguf").tensors[0]
    loaded = read_tensor(tensor)
    expected = torch.from_numpy(np.array(dequantize(tensor.data, qtype), np.float32))
    if qtype in FLOATS:
        assert isinstance(loaded, torch.Tensor) and loaded.dtype == FLOATS[qtype]
        assert exactly_equal(loaded.float(), expected)
    else:
        assert isinstance(loaded, QuantizedWeight) and loaded.shape == (24, 512)
        assert exactly_equal(loaded.dequantize(), expected)
        if loaded.bits == 4:
            assert 0 <= loaded.q.min() and loaded.q.max() <= 15
        # a k-quant keeps its block's steps: every scale (and offset) an int8 multiple of its block's
        assert (loaded.steps is not None) == (qtype in (T.Q4_K, T.Q5_K, T.Q6_K))
        if loaded.steps is not None:
            assert loaded.steps.shape == (24, 2) and loaded.per == 256 // loaded.group
            for value, step in [(loaded.scale, loaded.steps), (loaded.offset, loaded.offset_steps)]:
                if value is None:
                    assert step is None
                    continue
                step = step.repeat_interleave(loaded.per, dim=1)
                whole = torch.where(step == 0, torch.zeros_like(value), value / step)
                assert torch.equal(whole, whole.round()) and -128 <= whole.min() and whole.max() <= 127
                assert torch.equal(whole * step, value)


def test_rows_reordered_before_decoding_are_the_same_rows(tmp_path):
    write_gguf(tmp_path / "t.gguf", {"w": (T.Q4_K, random_blocks(T.Q4_K, 16, 256))})
    tensor = TensorReader(tmp_path / "t.gguf").tensors[0]
    order = np.random.default_rng(1).permutation(16)
    assert exactly_equal(read_tensor(tensor, row_order=order).dequantize(),
                         read_tensor(tensor).dequantize()[torch.from_numpy(order)])


def test_another_type_is_refused_by_name_or_dequantized(tmp_path):
    write_gguf(tmp_path / "t.gguf", {"blk.0.ffn_up.weight": (T.Q2_K, random_blocks(T.Q2_K, 4, 256))})
    tensor = TensorReader(tmp_path / "t.gguf").tensors[0]
    with pytest.raises(UnsupportedTensorType, match=r"blk\.0\.ffn_up\.weight.*Q2_K"):
        read_tensor(tensor)
    loaded = read_tensor(tensor, dequantize_unsupported=True)
    assert exactly_equal(loaded, torch.from_numpy(dequantize(tensor.data, T.Q2_K)))


def test_the_tensor_reader_skips_only_array_values(tmp_path):
    write_gguf(tmp_path / "t.gguf", {"w": (T.Q8_0, raw_tensor(T.Q8_0, 4, 64))}, block_count=3,
               token_list=[f"tok{i}" for i in range(300)], token_scores=[0.5] * 300)
    fast, full = TensorReader(tmp_path / "t.gguf"), GGUFReader(tmp_path / "t.gguf")
    assert list(fast.fields) == list(full.fields)
    assert fast.fields["llama.block_count"].contents() == 3
    assert [(t.name, t.data_offset, t.n_bytes) for t in fast.tensors] == \
        [(t.name, t.data_offset, t.n_bytes) for t in full.tensors]


# Tiny models with grouped-query attention (so llama's q and k are permuted differently) and a
# different block type for each projection: a llama with an F16 lm_head, a qwen2 with q/k/v biases
# and the lm_head tied to its Q8_0 embedding.
HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, LAYERS = 256, 4, 2, 512, 96, 2
KV = HIDDEN // HEADS * KV_HEADS
LAYER = {"attn_q": (T.Q4_K, HIDDEN), "attn_k": (T.Q6_K, KV), "attn_v": (T.Q5_0, KV),
         "attn_output": (T.Q4_1, HIDDEN), "ffn_gate": (T.Q5_K, FFN), "ffn_up": (T.Q4_0, FFN)}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_gguf(request, tmp_path_factory):
    arch = request.param
    path = tmp_path_factory.mktemp("gguf") / f"{arch}.gguf"
    rng = np.random.default_rng(0)

    def floats(*shape, dtype=np.float32):
        return rng.uniform(0.5, 1.5, shape).astype(dtype)
    tensors = {"token_embd.weight": (T.Q8_0, raw_tensor(T.Q8_0, VOCAB, HIDDEN)),
               "output_norm.weight": (T.F32, floats(HIDDEN))}
    if arch == "llama":
        tensors["output.weight"] = (T.F16, floats(VOCAB, HIDDEN, dtype=np.float16))
    for i in range(LAYERS):
        for j, (name, (qtype, rows)) in enumerate(LAYER.items()):
            tensors[f"blk.{i}.{name}.weight"] = (qtype, raw_tensor(qtype, rows, HIDDEN, seed=10 * i + j))
            if arch == "qwen2" and name in ("attn_q", "attn_k", "attn_v"):
                tensors[f"blk.{i}.{name}.bias"] = (T.F32, floats(rows))
        tensors[f"blk.{i}.ffn_down.weight"] = (T.Q5_1, raw_tensor(T.Q5_1, HIDDEN, FFN, seed=i))
        for norm in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{norm}.weight"] = (T.F32, floats(HIDDEN))
    write_gguf(path, tensors, arch, block_count=LAYERS, context_length=128, embedding_length=HIDDEN,
               feed_forward_length=FFN, head_count=HEADS, head_count_kv=KV_HEADS, vocab_size=VOCAB,
               layer_norm_rms_eps=1e-5, rope_freq_base=10000.0, rope_dimension_count=HIDDEN // HEADS)
    return path


def transformers_load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def dequantized(model: torch.nn.Module) -> torch.nn.Module:
    """The skeleton with every quantized weight put back as float: the reference forward."""
    for module in model.modules():
        if hasattr(module, "quantized"):
            module.weight = torch.nn.Parameter(module.quantized.dequantize(), requires_grad=False)
    return model


def assert_same_as_transformers(path, theirs, config=None) -> tuple[dict, torch.nn.Module]:
    config, weights = load_gguf(path, config)
    expected = dict(theirs.named_parameters())
    assert set(weights) == set(expected)
    for name, value in weights.items():
        mine = value.dequantize() if isinstance(value, QuantizedWeight) else value.float()
        assert exactly_equal(mine, expected[name].detach()), name
    model = build_model(config, weights)
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            quantized = isinstance(weights.get(f"{name}.weight"), QuantizedWeight) or (
                name == "lm_head" and config.tie_word_embeddings)
            assert hasattr(module, "quantized") == quantized, name
            assert module.weight.numel() == 0 if quantized else module.weight.is_floating_point(), name
    ids = torch.tensor([[1, 5, 9, 2, 7, 30, 11]])
    with torch.no_grad():
        assert torch.allclose(dequantized(model)(ids).logits, theirs(ids).logits, atol=1e-5, rtol=1e-5)
    return weights, model


def test_tiny_models_load_as_transformers_loads_them(tiny_gguf):
    weights, model = assert_same_as_transformers(tiny_gguf, transformers_load(tiny_gguf))
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert (q.bits, q.group, q.offset is not None) == (4, 32, True)  # Q4_K (llama: rows permuted)
    if "lm_head.weight" in weights:
        assert weights["lm_head.weight"].dtype == torch.float16  # F16 stays F16 until build_model
    else:
        assert model.lm_head.quantized is model.model.embed_tokens.quantized


@pytest.mark.slow
def test_the_default_model_loads_as_transformers_loads_it():
    from shared.model_source import default_gguf_path

    path = default_gguf_path()
    theirs = transformers_load(path)
    # Its config is the one gguf_config computes (the tiny models test that path): parsed once.
    weights, model = assert_same_as_transformers(path, theirs, theirs.config)
    assert model.lm_head.quantized is model.model.embed_tokens.quantized  # tied
    assert isinstance(weights["model.layers.0.mlp.up_proj.weight"], QuantizedWeight)


def decoded(qtype: T, rows: int, cols: int, seed: int) -> QuantizedWeight:
    return decode_blocks(raw_tensor(qtype, rows, cols, seed), qtype, (rows, cols))


def test_concat_rows_widens_mixed_formats_exactly():
    parts = [decoded(T.Q4_K, 8, 256, 0), decoded(T.Q4_K, 4, 256, 1), decoded(T.Q6_K, 4, 256, 2)]
    qkv = concat_rows(parts)
    assert (qkv.bits, qkv.group, qkv.shape) == (8, 16, (16, 256))
    assert exactly_equal(qkv.dequantize(), torch.cat([p.dequantize() for p in parts]))
    mixed = [decoded(T.Q8_0, 3, 256, 3), compress(torch.randn(5, 256), 4, 128), compress(torch.randn(2, 256), 8, 64)]
    assert exactly_equal(concat_rows(mixed).dequantize(), torch.cat([p.dequantize() for p in mixed]))
    same = [decoded(T.Q4_1, 6, 256, 4), decoded(T.Q4_1, 6, 256, 5)]
    gate_up = concat_rows(same)
    assert (gate_up.bits, gate_up.group) == (4, 32)
    assert exactly_equal(gate_up.dequantize(), torch.cat([p.dequantize() for p in same]))
    with pytest.raises(ValueError, match="different K"):
        concat_rows([decoded(T.Q8_0, 2, 256, 0), decoded(T.Q8_0, 2, 512, 0)])
