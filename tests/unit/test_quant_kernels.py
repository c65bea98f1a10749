"""The projection kernels (worker/model/csrc/quant_linear.cpp, quant_linear_int8.cpp, panel_linear.cpp)
through Weight, on every ISA this CPU runs and on the portable path, against dequantize-then-matmul
in float64 (on avx512vnni, of the activations rounded to int8 as that kernel rounds them)."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from shared.settings import WorkerSettings
from worker.model import kernels
from worker.model.fused_layers import Weight
from streamq.testing.k_quants import stepped_weight
from worker.model.quantized import QuantizedWeight, concat_rows

CPU = torch.device("cpu")
ROWS = [*range(1, 71), 128, 333, 512]  # every decode batch, then prefill chunks
FORMATS = list(itertools.product([4, 8], [16, 32], [True, False]))  # bits, group, offset


@pytest.fixture(scope="module")
def ops():
    built = kernels.load_from(WorkerSettings().kernel_cache_dir)
    assert built is not None, "the CPU step kernels failed to build (see the log)"
    return built


@pytest.fixture(params=["avx512vnni", "avx512", "avx2", "portable"])
def isa(request, ops):
    if request.param != "portable" and request.param not in ops.isas:
        pytest.skip(f"this CPU ({kernels.cpu_model()}) has no {request.param}; its kernels run on: "
                    f"{', '.join(ops.isas) or 'none'}")
    return request.param


def random_weight(n: int, k: int, bits: int, group: int, offset: bool, gen: torch.Generator) -> QuantizedWeight:
    """Codes over their whole range (8-bit: -128..127, 4-bit: 0..15), scales of both signs."""
    low, high = (-128, 128) if bits == 8 else (0, 16)
    q = torch.randint(low, high, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.randn((n, k // group), generator=gen) * 0.02
    return QuantizedWeight(q, scale, torch.randn(scale.shape, generator=gen) * 0.1 if offset else None, group, bits)


class Reference:
    """x @ dequantize(w).T + bias in float64, and the tolerance of a result: 2^-18 of each
    output's sum of absolute terms. fp32 sums in another order stay far inside it; a code, scale
    or offset off by one step in one group lands far outside."""

    def __init__(self, w: QuantizedWeight, bias: torch.Tensor | None):
        self.w, self.dq = w, w.dequantize().double()
        self.bias = None if bias is None else bias.double()
        terms = w.q.double().abs() * w.scale.double().abs().repeat_interleave(w.group, 1)
        if w.offset is not None:
            terms += w.offset.double().abs().repeat_interleave(w.group, 1)
        self.terms = terms.T.contiguous()

    def check(self, got: torch.Tensor, x: torch.Tensor, what: str, isa: str = "avx512") -> None:
        if isa == "avx512vnni":  # the codes meet x rounded to int8; the offsets the unrounded x
            rounded = int8_rounded(x, self.w.group).double()
            want = rounded @ (self.w.q.double() * self.w.scale.double().repeat_interleave(self.w.group, 1)).T
            if self.w.offset is not None:
                want -= x.double() @ self.w.offset.double().repeat_interleave(self.w.group, 1).T
            if self.bias is not None:
                want += self.bias
            x = rounded.abs() + x.double().abs()
        else:
            x = x.double()
            want = F.linear(x, self.dq, self.bias)
        size = x.abs() @ self.terms + (0 if self.bias is None else self.bias.abs())
        error = (got.double() - want).abs() / size
        assert error.max() <= 2 ** -18, \
            f"{what}: worst relative error {error.max():.3g} at {divmod(error.argmax().item(), got.shape[1])}"


def int8_rounded(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as quant_linear_int8 sees it: per row and group, dx = max|x| / 127 and round(x / dx) * dx,
    in fp32 with ties to even."""
    rows, k = x.shape
    xg = x.float().reshape(rows, k // group, group)
    dx = xg.abs().amax(-1, keepdim=True) / 127
    codes = torch.where(dx > 0, torch.round(xg / dx), torch.zeros_like(xg))
    return (codes * dx).reshape(rows, k)


@pytest.mark.parametrize("bits,group,offset", FORMATS)
def test_quantized_projection_is_the_dequantized_matmul_at_every_row_count(ops, isa, bits, group, offset):
    gen = torch.Generator().manual_seed(bits * 100 + group + offset)
    n, k = 70, 96  # a partial last panel of 32 columns; 96 = 6 groups of 16, 3 of 32
    w, b = random_weight(n, k, bits, group, offset, gen), torch.randn(n, generator=gen)
    with_bias, without = Weight(w, b, CPU, kernels.with_isa(ops, isa)), Weight(w, None, CPU, kernels.with_isa(ops, isa))
    assert with_bias.quant.isa == isa
    biased, plain = Reference(w, b), Reference(w, None)
    assert with_bias.quant.int8 == (isa == "avx512vnni")
    for rows in ROWS:
        x = torch.randn((rows, k), generator=gen)
        x[0, :group] = 0  # a group of zeros rounds to zeros
        biased.check(with_bias(x), x, f"{rows} rows, bias", isa)
        plain.check(without(x), x, f"{rows} rows", isa)


def test_int8_activations_are_rounded_per_group_to_the_nearest_even_step(ops):
    """Inputs whose x / dx falls exactly between two integers: the kernel rounds them as
    int8_rounded does (ties to even), so a reference that rounded away from zero would differ."""
    if "avx512vnni" not in ops.isas:
        pytest.skip(f"this CPU ({kernels.cpu_model()}) has no AVX-512 VNNI; its kernels run on: "
                    f"{', '.join(ops.isas) or 'none'}")
    w = QuantizedWeight(torch.eye(32, dtype=torch.int8), torch.ones(32, 1), None, 32, 8)
    weight = Weight(w, None, CPU, kernels.with_isa(ops, "avx512vnni"))
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 3.0, 0.0] + [0.0] * 24])  # dx = 1
    assert weight(x)[0, :8].tolist() == [127.0, 0.0, 2.0, 2.0, 0.0, -2.0, 3.0, 0.0]
    assert torch.equal(weight(x), int8_rounded(x, 32))


@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_is_computed_alone_bit_for_bit(ops, isa, bits):
    if isa == "portable":
        pytest.skip("the portable path is F.linear's: deterministic mode runs it in fixed tiles instead")
    gen = torch.Generator().manual_seed(7)
    w = random_weight(100, 128, bits, 16, True, gen)
    weight = Weight(w, torch.randn(100, generator=gen), CPU, kernels.with_isa(ops, isa))
    for rows in (70, 333):
        x = torch.randn((rows, 128), generator=gen)
        batch = weight(x)
        for i in range(rows):
            assert torch.equal(weight(x[i:i + 1]), batch[i:i + 1]), f"row {i} of {rows}"


def test_every_isa_gives_the_same_bits(ops):
    """The kernels run one sequence of roundings per lane, 8 or 16 lanes wide."""
    if len(ops.isas) < 2:
        pytest.skip(f"this CPU runs one ISA only ({', '.join(ops.isas) or 'none'})")
    gen = torch.Generator().manual_seed(8)
    x = torch.randn((13, 64), generator=gen)
    fp32 = [isa for isa in ops.isas if isa != "avx512vnni"]  # its activations are int8: its own bits
    for bits, group, offset in FORMATS:
        w = random_weight(40, 64, bits, group, offset, gen)
        packed = ops.pack_quantized(w.q, w.scale, w.offset, bits)
        outs = [ops.quant_linear(x, packed, 40, group, bits, None, isa) for isa in fp32]
        assert all(torch.equal(outs[0], out) for out in outs[1:]), (bits, group, offset)
    panels = ops.pack_panels(torch.randn((40, 64), generator=gen))
    outs = [ops.panel_linear(x, panels, 40, None, isa) for isa in ops.isas]
    assert all(torch.equal(outs[0], out) for out in outs[1:])


def test_a_float_projection_on_panels_is_the_matmul_at_every_row_count(ops, isa):
    gen = torch.Generator().manual_seed(9)
    w, b = torch.randn((70, 96), generator=gen), torch.randn(70, generator=gen)
    weight = Weight(w, b, CPU, kernels.with_isa(ops, isa))
    assert (weight.panels is not None) == weight.row_independent == (isa != "portable")  # portable: oneDNN
    for rows in ROWS:
        x = torch.randn((rows, 96), generator=gen)
        want = F.linear(x.double(), w.double(), b.double())
        size = x.double().abs() @ w.double().abs().T + b.double().abs()
        assert ((weight(x).double() - want).abs() / size).max() <= 2 ** -18, f"{rows} rows"
        if isa != "portable":
            assert torch.equal(weight(x[-1:]), weight(x)[-1:]), f"the last of {rows} rows alone"


def test_bf16_inputs_compute_in_fp32_and_round_once(ops, isa):
    gen = torch.Generator().manual_seed(10)
    w = random_weight(40, 64, 4, 32, True, gen)
    bias = torch.randn(40, generator=gen).to(torch.bfloat16)
    weight = Weight(w, bias, CPU, kernels.with_isa(ops, isa))
    x = torch.randn((5, 64), generator=gen).to(torch.bfloat16)
    got, full = weight(x), weight(x.float())
    assert got.dtype == torch.bfloat16 and full.dtype == torch.float32
    assert torch.equal(got, full.to(torch.bfloat16))
    Reference(w, bias.float()).check(full, x.float(), "bf16 x", isa)


@pytest.mark.parametrize("bits,offset", [(4, True), (8, False), (8, True)])
def test_a_packed_weight_holds_its_codes_at_their_width_and_no_float_copy(ops, isa, bits, offset):
    n, k, group = 96, 256, 32
    w = random_weight(n, k, bits, group, offset, torch.Generator().manual_seed(11))
    weight = Weight(w, None, CPU, kernels.with_isa(ops, isa))
    assert weight.w is None and weight.packed is None and weight.panels is None
    held = [t for t in vars(weight.quant).values() if isinstance(t, torch.Tensor)]
    assert all(t.dtype in (torch.int8, torch.uint8) or t.numel() <= w.scale.numel() for t in held)
    assert weight.quant.nbytes() == w.nbytes() == sum(t.numel() * t.element_size() for t in held)


@pytest.mark.parametrize("threads", [2, 3])
def test_several_threads_give_the_bits_of_one(ops, isa, threads):
    """The test processes compute on one thread each where two share 2 cores (tests/conftest.py);
    here the kernels split their panels over several threads, as a worker's do, on any CPU."""
    if isa == "portable":
        pytest.skip("the portable path is F.linear's: deterministic mode runs it in fixed tiles instead")
    gen = torch.Generator().manual_seed(14)
    x = torch.randn((48, 256), generator=gen)
    weights = [Weight(random_weight(320, 256, 4, 32, True, gen), None, CPU, kernels.with_isa(ops, isa)),
               Weight(torch.randn((320, 256), generator=gen), None, CPU, kernels.with_isa(ops, isa))]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [weight(x) for weight in weights]
        torch.set_num_threads(threads)
        assert torch.get_num_threads() == threads
        assert all(torch.equal(weight(x), want) for weight, want in zip(weights, alone))
    finally:
        torch.set_num_threads(before)


def test_concatenated_weights_of_different_formats_dequantize_to_the_parts(ops):
    gen = torch.Generator().manual_seed(13)
    parts = [random_weight(32, 64, 4, 32, True, gen), random_weight(16, 64, 8, 16, False, gen),
             random_weight(8, 64, 8, 32, True, gen)]
    fused = concat_rows(parts)
    assert (fused.bits, fused.group) == (8, 16)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_an_isa_this_cpu_lacks_is_refused_naming_both(ops):
    with pytest.raises(RuntimeError, match=r"isa 'avx1024'.*only on: " + (", ".join(ops.isas) or "none")):
        ops.quant_linear(torch.zeros((1, 32)), torch.zeros((1, 1, 640), dtype=torch.uint8), 8, 32, 4, None, "avx1024")
    missing = [isa for isa in ("avx512vnni", "avx512", "avx2") if isa not in ops.isas]
    if not missing:
        pytest.skip(f"this CPU runs every ISA ({', '.join(ops.isas)})")
    with pytest.raises(ValueError, match=f"cpu_isa={missing[0]} .*only on: {', '.join([*ops.isas, 'portable'])}"):
        kernels.with_isa(ops, missing[0])


def test_the_isa_setting_takes_the_five_names_only(monkeypatch):
    monkeypatch.setenv("STREAMQ_CPU_ISA", "portable")
    assert WorkerSettings().cpu_isa == "portable"
    monkeypatch.setenv("STREAMQ_CPU_ISA", "avx3")
    with pytest.raises(ValueError, match="cpu_isa"):
        WorkerSettings()


@pytest.mark.parametrize("bits,group,offset", FORMATS)
def test_float_activations_compute_the_dequantized_matmul_on_every_isa(ops, isa, bits, group, offset):
    """Within float_activations (pooling), every packing, the int8-activation one included, gives
    x @ dequantize(w).T with x unrounded; outside it, VNNI's still rounds x to int8."""
    from worker.model.quant_linear import float_activations

    gen = torch.Generator().manual_seed(bits * 10 + group + offset)
    n, k = 70, 96
    w, b = random_weight(n, k, bits, group, offset, gen), torch.randn(n, generator=gen)
    weight, reference = Weight(w, b, CPU, kernels.with_isa(ops, isa)), Reference(w, b)
    x = torch.randn((5, k), generator=gen)
    with float_activations():
        reference.check(weight(x), x, "float activations", "avx512")
    reference.check(weight(x), x, "as served", isa)


@pytest.mark.parametrize("bits,group,offset", FORMATS)
def test_rows_read_back_from_every_packing_are_the_dequantized_rows(ops, isa, bits, group, offset):
    """A tied embedding's lookup (QuantLinear.rows) reads the kernels' own packing back: the rows
    of dequantize(), bit for bit, in any order, the partial last panel's too."""
    gen = torch.Generator().manual_seed(bits + group + offset)
    w = random_weight(70, 96, bits, group, offset, gen)
    quant = Weight(w, None, CPU, kernels.with_isa(ops, isa)).quant
    index = torch.tensor([69, 0, 33, 33, 64, 5, 31, 32])
    assert torch.equal(quant.rows(index), w.dequantize()[index])
    if quant.packed is not None:
        with pytest.raises(RuntimeError, match="out of range"):
            quant.rows(torch.tensor([96]))


def plain(w: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(w.q, w.scale, w.offset, w.group, w.bits)


K_QUANTS = [(4, 32, 8, True), (8, 16, 16, False), (8, 32, 8, True)]  # Q4_K, Q6_K, Q5_K (codes 8 bits wide)


@pytest.mark.parametrize("bits,group,per,offset", K_QUANTS)
def test_super_blocks_give_the_plain_packings_bits_in_fewer_bytes(ops, bits, group, per, offset):
    """A k-quant's scales packed as a byte a group under a float step a super-block: the kernel
    multiplies them back exactly, so every row count gives the plain packing's bits, with and
    without bias; the rows read back are the dequantized rows; and the weight takes fewer bytes."""
    if "avx512vnni" not in ops.isas:
        pytest.skip(f"this CPU ({kernels.cpu_model()}) has no avx512vnni; its kernels run on: {', '.join(ops.isas)}")
    gen = torch.Generator().manual_seed(bits + group + per)
    n, k = 70, 512  # a partial last panel; two super-blocks of 256
    w, b = stepped_weight(n, k, bits, group, per, offset, gen), torch.randn(n, generator=gen)
    vnni = kernels.with_isa(ops, "avx512vnni")
    stepped, flat = Weight(w, b, CPU, vnni), Weight(plain(w), b, CPU, vnni)
    assert (stepped.quant.per, flat.quant.per) == (per, 0)
    assert stepped.quant.nbytes() < flat.quant.nbytes()
    for rows in ROWS:
        x = torch.randn((rows, k), generator=gen)
        assert torch.equal(stepped(x), flat(x)), rows
    Reference(w, b).check(stepped(x), x, "512 rows", "avx512vnni")
    for i in (0, 5, 6, 47, 48, 511):  # a row alone (a block's kernel) as in 512 (widened once for 48)
        assert torch.equal(stepped(x[i:i + 1]), stepped(x)[i:i + 1]), i
    index = torch.tensor([69, 0, 33, 33, 64, 5, 31, 32])
    assert torch.equal(stepped.quant.rows(index), w.dequantize()[index])
    layers = ops.Projection.quantized_int8(stepped.quant.packed, n, group, bits, b, per)
    assert torch.equal(layers(x[:1]), flat(x[:1]))


def test_a_scale_that_is_not_a_whole_multiple_of_its_step_is_refused(ops):
    if "avx512vnni" not in ops.isas:
        pytest.skip(f"this CPU ({kernels.cpu_model()}) has no avx512vnni; its kernels run on: {', '.join(ops.isas)}")
    gen = torch.Generator().manual_seed(5)
    w = stepped_weight(32, 256, 4, 32, 8, True, gen)
    w.scale[3, 2] += w.steps[3, 0] / 2
    with pytest.raises(RuntimeError, match="not a whole multiple"):
        ops.pack_quantized_int8(w.q, w.scale, w.offset, 4, w.steps, w.offset_steps)


def test_q4_k_beside_q6_k_keeps_its_steps_when_stacked(ops):
    """A Q4_K_M layer's q and k (Q4_K) beside its v (Q6_K): one projection that keeps the steps
    (both span 256 of k), dequantizes to the parts and, on VNNI, gives the plain packing's bits."""
    gen = torch.Generator().manual_seed(17)
    parts = [stepped_weight(32, 256, 4, 32, 8, True, gen), stepped_weight(16, 256, 8, 16, 16, False, gen)]
    fused = concat_rows(parts)
    assert (fused.bits, fused.group, fused.per) == (8, 16, 16)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    assert torch.equal(fused.offset_steps[32:], torch.zeros(16, 1))
    assert concat_rows([parts[0], plain(parts[1])]).steps is None  # steps only where every part has them
    if "avx512vnni" in ops.isas:
        vnni = kernels.with_isa(ops, "avx512vnni")
        x = torch.randn((3, 256), generator=gen)
        assert torch.equal(Weight(fused, None, CPU, vnni)(x), Weight(plain(fused), None, CPU, vnni)(x))


@pytest.mark.parametrize("group,per,offset", [(16, 16, False), (32, 8, True), (32, 0, True)])
def test_codes_of_six_bits_are_packed_six_bits_wide_with_the_bits_of_eight(ops, group, per, offset):
    """Q6_K's codes (-32..31; Q5_*'s, and 4-bit ones stacked beside them) stored 6 bits wide, with
    and without super-blocks: the same bits as the 8-bit packing at every row count, the rows read
    back, and three quarters of the codes' bytes."""
    if "avx512vnni" not in ops.isas:
        pytest.skip(f"this CPU ({kernels.cpu_model()}) has no avx512vnni; its kernels run on: {', '.join(ops.isas)}")
    gen = torch.Generator().manual_seed(group + per)
    n, k = 70, 512
    w = stepped_weight(n, k, 8, group, per or 1, offset, gen)
    w.q = torch.randint(-32, 32, (n, k), generator=gen, dtype=torch.int8)
    if not per:
        w = plain(w)
    b = torch.randn(n, generator=gen)
    weight = Weight(w, b, CPU, kernels.with_isa(ops, "avx512vnni"))
    assert weight.quant.bits == 6
    steps = (w.steps, w.offset_steps) if per else (None, None)
    eight = ops.pack_quantized_int8(w.q, w.scale, w.offset, 8, *steps)
    panels = (n + 31) // 32
    assert eight.numel() - weight.quant.packed.numel() == panels * 32 * k // 4  # a quarter of each code's byte
    for rows in ROWS:
        x = torch.randn((rows, k), generator=gen)
        want = ops.quant_linear_int8(x, eight, n, group, 8, b, per=per)
        assert torch.equal(weight(x), want), rows
    Reference(w, b).check(weight(x), x, "512 rows", "avx512vnni")
    for i in (0, 5, 6, 47, 48, 511):  # a row alone (a block's kernel) as in 512 (widened once for 48)
        assert torch.equal(weight(x[i:i + 1]), weight(x)[i:i + 1]), i
    index = torch.tensor([69, 0, 33, 33, 64, 5, 31, 32])
    assert torch.equal(weight.quant.rows(index), w.dequantize()[index])
    with pytest.raises(RuntimeError, match="6-bit codes must be -32..31"):
        ops.pack_quantized_int8(w.q * 2, w.scale, w.offset, 6, *steps)
