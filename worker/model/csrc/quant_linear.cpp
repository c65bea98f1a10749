// quant_linear: x @ w.T (+ bias) for a weight kept as 4- or 8-bit codes with a scale and an
// offset per row and group of k (worker/model/quantized.py): w[n, k] = q[n, k] * scale[n, g] - offset[n, g].
//
// A decode step streams every weight once, so its cost is the weight's bytes: a quarter (8-bit)
// or an eighth (4-bit) of fp32's, plus the scales. The codes are never expanded in memory; each
// panel row is widened to floats in registers and fed to fp32 fused multiply-adds, factored as
//   out[r, n] = sum_g (scale[n, g] * sum_{k in g} x[r, k] q[n, k] - offset[n, g] * sum_{k in g} x[r, k])
// so a code costs one conversion and one FMA per row. Every row's sum runs in the same order
// whatever the other rows of the call: a row's result is its own (as panel_linear's).
//
// Packed (pack_groups): [ceil(N / 32), K / group, group_bytes], per panel of 32 columns and group of k the
// group's codes (group rows of 32 codes, simd.h's layout), then 32 scales, then 32 offsets where
// the weight has them; columns past N are zero.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "simd.h"

namespace streamq {
namespace {

// Where a block reads and writes: R rows of x from `x`, P adjacent panels from `panel`, total [R][P * 32].
struct Block {
  const float* x;
  int64_t k;
  const float* xsum;  // [rows][groups] where the weight has offsets
  const uint8_t* panel;
  int64_t panel_bytes, group, stride;
  bool offset;
  float* total;
};

// R rows over P adjacent panels, their vectors v0 .. v0 + V - 1: R x P x V accumulators, each a
// group's sum of x * code, then folded into the total with the group's scale and offset.
template <class S, int Bits, int R, int P, int V>
void quant_block(const Block& b, int v0) {
  using F = typename S::F;
  constexpr int64_t row_bytes = kPanel * Bits / 8, width = P * kPanel;
  const int64_t groups = b.k / b.group;
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < P; ++j)
      for (int v = 0; v < V; ++v) S::store(b.total + r * width + j * kPanel + (v0 + v) * S::kWidth, S::zero());
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = b.x + g * b.group;
    const uint8_t* codes = b.panel + g * b.stride;
    F acc[R][P][V];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < P; ++j)
        for (int v = 0; v < V; ++v) acc[r][j][v] = S::zero();
    for (int64_t i = 0; i < b.group; ++i) {
      if constexpr (P == 1) {  // the panel row's codes widened once into registers, then a row at a time
        F w[V];
        for (int v = 0; v < V; ++v) w[v] = S::template codes<Bits>(codes + i * row_bytes, v0 + v);
        for (int r = 0; r < R; ++r) {
          const F a = S::broadcast(xg[r * b.k + i]);
          for (int v = 0; v < V; ++v) acc[r][0][v] = S::fma(a, w[v], acc[r][0][v]);
        }
      } else {  // one or two rows, a vector of a panel at a time
        F a[R];
        for (int r = 0; r < R; ++r) a[r] = S::broadcast(xg[r * b.k + i]);
        for (int j = 0; j < P; ++j)
          for (int v = 0; v < V; ++v) {
            const F w = S::template codes<Bits>(codes + j * b.panel_bytes + i * row_bytes, v0 + v);
            for (int r = 0; r < R; ++r) acc[r][j][v] = S::fma(a[r], w, acc[r][j][v]);
          }
      }
    }
    for (int j = 0; j < P; ++j) {
      const float* scale = reinterpret_cast<const float*>(codes + j * b.panel_bytes + b.group * row_bytes);
      for (int v = 0; v < V; ++v) {
        const F s = S::load(scale + (v0 + v) * S::kWidth);
        const F o = b.offset ? S::load(scale + kPanel + (v0 + v) * S::kWidth) : S::zero();
        for (int r = 0; r < R; ++r) {
          float* t = b.total + r * width + j * kPanel + (v0 + v) * S::kWidth;
          F sum = S::fma(acc[r][j][v], s, S::load(t));
          if (b.offset) sum = S::fnma(o, S::broadcast(b.xsum[r * groups + g]), sum);
          S::store(t, sum);
        }
      }
    }
  }
}

// With AVX2's 16 registers, a block of more than two rows covers its panel in two passes of 16 columns.
template <class S, int Bits, int R, int P>
void quant_rows(const Block& b) {
  constexpr int V = kPanel / S::kWidth;
  if constexpr (V == 4 && R > 2) {
    quant_block<S, Bits, R, P, 2>(b, 0);
    quant_block<S, Bits, R, P, 2>(b, 2);
  } else {
    quant_block<S, Bits, R, P, V>(b, 0);
  }
}

// Blocks of rows as many as keep the accumulators in registers; one or two rows take several
// panels at once instead, so that enough independent sums are in flight to hide the FMA's latency.
template <class S, int Bits>
void quant_linear_impl(const float* x, const float* xsum, const uint8_t* packed, const float* bias, float* out,
                       int64_t m, int64_t k, int64_t n, int64_t group, bool offset) {
  constexpr bool avx2 = S::kWidth == 8;
  // AVX-512: 8 rows (16 accumulators). 10 measured 1.2-1.7x slower per call at 32 and 256 rows on an
  // AMD EPYC with AVX-512 (docs/models.md, "Kernels"), 5 and 7 a little slower than 8.
  constexpr int64_t max_rows = avx2 ? 5 : 8;
  const int64_t stride = group_bytes(group, Bits, offset), panels = (n + kPanel - 1) / kPanel;
  const int64_t groups = k / group, panel_bytes = groups * stride;
  const int64_t wide = m == 1 ? (avx2 ? 2 : 4) : m == 2 && !avx2 ? 2 : 1;
  at::parallel_for(0, panels, panel_grain(m, k), [&](int64_t begin, int64_t end) {
    alignas(64) float total[max_rows * kPanel * 4];
    for (int64_t p = begin; p < end;) {
      const int64_t count = end - p >= wide ? wide : 1;
      for (int64_t r0 = 0; r0 < m; r0 += max_rows) {
        const int64_t rows = std::min(max_rows, m - r0);
        const Block b{x + r0 * k, k, offset ? xsum + r0 * groups : nullptr, packed + p * panel_bytes, panel_bytes,
                      group, stride, offset, total};
        if (count == 4) {
          quant_rows<S, Bits, 1, 4>(b);
        } else if (count == 2) {
          rows == 1 ? quant_rows<S, Bits, 1, 2>(b) : quant_rows<S, Bits, 2, 2>(b);
        } else {
          switch (rows) {
#define STREAMQ_ROWS(R) \
  case R: quant_rows<S, Bits, R, 1>(b); break;
            STREAMQ_ROWS(1) STREAMQ_ROWS(2) STREAMQ_ROWS(3) STREAMQ_ROWS(4) STREAMQ_ROWS(5)
            default:
              if constexpr (!avx2) {
                switch (rows) { STREAMQ_ROWS(6) STREAMQ_ROWS(7) STREAMQ_ROWS(8) STREAMQ_ROWS(9) STREAMQ_ROWS(10) }
              }
#undef STREAMQ_ROWS
          }
        }
        for (int64_t j = 0; j < count; ++j) {
          const int64_t n0 = (p + j) * kPanel, left = std::min<int64_t>(kPanel, n - n0);
          for (int64_t r = 0; r < rows; ++r) {
            float* o = out + (r0 + r) * n + n0;
            const float* t = total + (r * count + j) * kPanel;
            for (int64_t c = 0; c < left; ++c) o[c] = bias ? t[c] + bias[n0 + c] : t[c];
          }
        }
      }
      p += count;
    }
  });
}

template <class S>
void dispatch_bits(int64_t bits, const float* x, const float* xsum, const uint8_t* packed, const float* bias,
                   float* out, int64_t m, int64_t k, int64_t n, int64_t group, bool offset) {
  if (bits == 8)
    quant_linear_impl<S, 8>(x, xsum, packed, bias, out, m, k, n, group, offset);
  else
    quant_linear_impl<S, 4>(x, xsum, packed, bias, out, m, k, n, group, offset);
}

}  // namespace

void check_pack(const at::Tensor& q, const at::Tensor& scale, const c10::optional<at::Tensor>& offset, int64_t bits) {
  check_rows(q, "q");
  check_rows(scale, "scale");
  TORCH_CHECK(q.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat, "q: int8, scale: float32");
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "bits: 4, 6 or 8, not ", bits);
  const int64_t n = q.size(0), k = q.size(1), groups = scale.size(1);
  TORCH_CHECK(scale.size(0) == n && groups > 0 && k % groups == 0, "scale must be [N, K / group]");
  if (offset) {
    check_rows(*offset, "offset");
    TORCH_CHECK(offset->sizes() == scale.sizes() && offset->scalar_type() == at::kFloat, "offset must match scale");
  }
  if (bits == 4) TORCH_CHECK(q.min().item<int>() >= 0 && q.max().item<int>() <= 15, "4-bit codes must be 0..15");
  if (bits == 6) TORCH_CHECK(q.min().item<int>() >= -32 && q.max().item<int>() <= 31, "6-bit codes must be -32..31");
}

at::Tensor pack_groups(at::Tensor q, at::Tensor scale, c10::optional<at::Tensor> offset, int64_t bits,
                       PlaceCode place) {
  check_pack(q, scale, offset, bits);
  const int64_t n = q.size(0), k = q.size(1), groups = scale.size(1);
  const int64_t group = k / groups, stride = group_bytes(group, bits, offset.has_value()), panels = (n + 31) / 32;
  at::Tensor packed = at::zeros({panels, groups, stride}, q.options().dtype(at::kByte));
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* op = offset ? offset->data_ptr<float>() : nullptr;
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, panels * groups, panel_grain(1, group), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = item / groups, g = item % groups, columns = std::min<int64_t>(32, n - p * 32);
      uint8_t* block = dst + item * stride;
      float* scales = reinterpret_cast<float*>(block + group * kPanel * bits / 8);
      for (int64_t j = 0; j < columns; ++j) {
        const int64_t row = p * 32 + j;
        place(block, j, qp + row * k + g * group, group, bits);
        std::memcpy(scales + j, sp + row * groups + g, sizeof(float));
        if (op) std::memcpy(scales + 32 + j, op + row * groups + g, sizeof(float));
      }
    }
  });
  return packed;
}

// This kernel's layout (above): a group's k-th row of 32 codes, 8-bit a byte each, 4-bit column j in
// byte j % 16 (the low nibble for j < 16).
at::Tensor pack_quantized(at::Tensor q, at::Tensor scale, c10::optional<at::Tensor> offset, int64_t bits) {
  TORCH_CHECK(bits != 6, "pack_quantized: 6-bit codes are pack_quantized_int8's (VNNI) only");
  return pack_groups(q, scale, offset, bits, [](uint8_t* block, int64_t j, const int8_t* codes, int64_t group,
                                                int64_t bits) {
    for (int64_t i = 0; i < group; ++i) {
      const auto code = static_cast<uint8_t>(codes[i]);
      if (bits == 8)
        block[i * 32 + j] = code;
      else
        block[i * 16 + j % 16] |= j < 16 ? code : uint8_t(code << 4);
    }
  });
}

at::Tensor unpack_rows(const at::Tensor& packed, const at::Tensor& rows, int64_t group, int64_t bits, ReadCode read) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3,
              "a packed weight [panels, groups, bytes] of uint8");
  TORCH_CHECK((bits == 4 || bits == 6 || bits == 8) && group > 0, "bits 4, 6 or 8 (not ", bits, "), group > 0");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "rows: int64 [T]");
  const int64_t panels = packed.size(0), groups = packed.size(1), stride = packed.size(2), k = groups * group;
  const bool offset = stride == group_bytes(group, bits, true);
  TORCH_CHECK(offset || stride == group_bytes(group, bits, false), "packed is not ", bits, "-bit in groups of ", group);
  const at::Tensor index = rows.contiguous();
  const int64_t* rp = index.data_ptr<int64_t>();
  const int64_t t = index.numel();
  for (int64_t r = 0; r < t; ++r) TORCH_CHECK(rp[r] >= 0 && rp[r] < panels * 32, "row ", rp[r], " is out of range");
  at::Tensor out = at::empty({t, k}, packed.options().dtype(at::kFloat));
  const uint8_t* src = packed.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, t, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t p = rp[r] / 32, j = rp[r] % 32;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* block = src + (p * groups + g) * stride;
        const uint8_t* floats = block + group * kPanel * bits / 8;
        float scale = 0, shift = 0;
        std::memcpy(&scale, floats + 4 * j, sizeof(float));
        if (offset) std::memcpy(&shift, floats + 4 * (32 + j), sizeof(float));
        float* w = dst + r * k + g * group;
        for (int64_t i = 0; i < group; ++i) w[i] = static_cast<float>(read(block, j, i, bits)) * scale - shift;
      }
    }
  });
  return out;
}

at::Tensor quantized_rows(at::Tensor packed, at::Tensor rows, int64_t group, int64_t bits) {
  return unpack_rows(packed, rows, group, bits, [](const uint8_t* block, int64_t j, int64_t i, int64_t bits) -> int {
    if (bits == 8) return static_cast<int8_t>(block[i * 32 + j]);
    const uint8_t byte = block[i * 16 + j % 16];
    return j < 16 ? byte & 15 : byte >> 4;
  });
}

bool check_quant_call(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t group, int64_t bits,
                      const c10::optional<at::Tensor>& bias, const char* name, const char* packer) {
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, name, ": x float32 or bfloat16");
  TORCH_CHECK((bits == 4 || bits == 6 || bits == 8) && group > 0, name, ": bits 4, 6 or 8 (not ", bits,
              "), group > 0");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == (n + 31) / 32 && packed.size(1) * group == x.size(1),
              name, ": packed must be ", packer, " of a weight [n, K] in groups of ", group);
  const int64_t stride = packed.size(2);
  const bool offset = stride == group_bytes(group, bits, true);
  TORCH_CHECK(offset || stride == group_bytes(group, bits, false), name, ": packed is not ", bits,
              "-bit in groups of ", group);
  if (bias) TORCH_CHECK(bias->is_contiguous() && bias->numel() == n, "bad bias");
  return offset;
}

at::Tensor quant_linear(at::Tensor x, at::Tensor packed, int64_t n, int64_t group, int64_t bits,
                        c10::optional<at::Tensor> bias, const std::string& isa) {
  TORCH_CHECK(bits != 6, "quant_linear: 6-bit codes are quant_linear_int8's (VNNI) only");
  const Isa chosen = float_isa(choose_isa(isa));
  x = x.contiguous();
  const bool offset = check_quant_call(x, packed, n, group, bits, bias, "quant_linear", "pack_quantized");
  const auto dtype = x.scalar_type();
  const int64_t m = x.size(0), k = x.size(1);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor bf = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor out = at::empty({m, n}, xf.options());
  if (m == 0) return out.to(dtype);
  // Each row's sum over each group, for the offsets: in double over k in order, rounded once.
  std::vector<float> xsum(offset ? m * (k / group) : 0);
  const float* xp = xf.data_ptr<float>();
  for (size_t i = 0; i < xsum.size(); ++i) {
    double total = 0;
    for (int64_t j = 0; j < group; ++j) total += xp[i * group + j];
    xsum[i] = static_cast<float>(total);
  }
  const float* xsp = offset ? xsum.data() : nullptr;
  const float* bp = bias ? bf.data_ptr<float>() : nullptr;
#if defined(STREAMQ_AVX512)
  if (chosen == Isa::kAvx512)
    dispatch_bits<Avx512>(bits, xf.data_ptr<float>(), xsp, packed.data_ptr<uint8_t>(), bp, out.data_ptr<float>(), m,
                          k, n, group, offset);
#endif
#if defined(STREAMQ_AVX2)
  if (chosen == Isa::kAvx2)
    dispatch_bits<Avx2>(bits, xf.data_ptr<float>(), xsp, packed.data_ptr<uint8_t>(), bp, out.data_ptr<float>(), m, k,
                        n, group, offset);
#endif
  return out.to(dtype);
}

}  // namespace streamq
