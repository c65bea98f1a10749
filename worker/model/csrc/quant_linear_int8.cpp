// quant_linear_int8: x @ w.T (+ bias) for a weight of 4- or 8-bit codes (worker/model/quantized.py), with
// x rounded to int8 per row and group of k, and the products summed in int32 by AVX-512 VNNI's
// VPDPBUSD (four byte products a lane, 64 a vector, in one instruction): llama.cpp's way on CPUs.
// Where quant_linear widens every code to a float and spends an FMA on it for each row, here four
// codes cost a quarter of an instruction a row, so a decode step is bound by the weight's bytes
// again rather than by the widening.
//
// A row's group of k is rounded as dx = max|x| / 127, xq = round-half-even(x / dx) in fp32 (dx = 0
// gives xq = 0), and a group's term is
//   scale[n, g] * dx[r, g] * sum_{k in g} xq[r, k] c[n, k]  -  offset[n, g] * sum_{k in g} x[r, k]
// with the integer sum exact, the offsets' sum over the unrounded x (as quant_linear's), and the
// groups folded in order: a row's result is its own, whatever the other rows of the call.
//
// Packed: [ceil(N / 32), K / group, group_bytes] as pack_quantized's, but a group's codes in
// quads of k: per quad, lane j (of 32 columns) holds its column's 4 codes in 4 adjacent bytes.
// 8-bit: 128 bytes a quad, columns 0-15 then 16-31, each code stored as c + 128 (VPDPBUSD takes
// the weight's bytes unsigned), taken off again as 128 * sum xq. 4-bit: 64 bytes a quad, columns
// 0-15 in the low nibbles, 16-31 in the high ones. Then 32 scales, then 32 offsets where there are.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "simd.h"

namespace streamq {
namespace {

#if defined(STREAMQ_VNNI)
// The rows' activations as the kernel reads them: codes [m, k], and per row and group the step dx,
// the codes' sum (for the 8-bit codes' +128) and the unrounded sum (for the offsets).
struct Rounded {
  std::vector<int8_t> xq;
  std::vector<float> dx, xsum;
  std::vector<int32_t> xqsum;
};

Rounded round_rows(const float* x, int64_t m, int64_t k, int64_t group, bool offset) {
  const int64_t groups = k / group;
  Rounded out{std::vector<int8_t>(m * k), std::vector<float>(m * groups), std::vector<float>(offset ? m * groups : 0),
              std::vector<int32_t>(m * groups)};
  for (int64_t i = 0; i < m * groups; ++i) {
    const float* xg = x + i * group;
    float amax = 0;
    double total = 0;
    for (int64_t j = 0; j < group; ++j) {
      amax = std::max(amax, std::fabs(xg[j]));
      total += xg[j];
    }
    const float dx = amax / 127.0f;
    int32_t sum = 0;
    for (int64_t j = 0; j < group; ++j) {
      const float q = dx > 0 ? std::nearbyint(xg[j] / dx) : 0.0f;
      const auto code = static_cast<int8_t>(std::clamp(q, -127.0f, 127.0f));
      out.xq[i * group + j] = code;
      sum += code;
    }
    out.dx[i] = dx;
    out.xqsum[i] = sum;
    if (offset) out.xsum[i] = static_cast<float>(total);
  }
  return out;
}

struct Block {
  const int8_t* xq;
  const float* dx;
  const int32_t* xqsum;
  const float* xsum;  // where the weight has offsets
  int64_t k;
  const uint8_t* panel;
  int64_t panel_bytes, group, stride;
  bool offset;
  float* total;  // [R][P * 32]
};

// R rows over P adjacent panels: per group, R x P x 2 int32 accumulators of 16 columns, folded
// into R x P x 2 float totals with the group's scales and offsets.
template <int Bits, int R, int P>
void int8_block(const Block& b) {
  constexpr int64_t quad_bytes = kPanel * 4 * Bits / 8;
  const int64_t groups = b.k / b.group, quads = b.group / 4;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 total[R][P][2];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < P; ++j) total[r][j][0] = total[r][j][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* codes = b.panel + g * b.stride;
    __m512i acc[R][P][2];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < P; ++j) acc[r][j][0] = acc[r][j][1] = _mm512_setzero_si512();
    for (int64_t q = 0; q < quads; ++q) {
      __m512i w[P][2];
      for (int j = 0; j < P; ++j) {
        const uint8_t* quad = codes + j * b.panel_bytes + q * quad_bytes;
        if constexpr (Bits == 8) {
          w[j][0] = _mm512_loadu_si512(quad);
          w[j][1] = _mm512_loadu_si512(quad + 64);
        } else {
          const __m512i both = _mm512_loadu_si512(quad);
          w[j][0] = _mm512_and_si512(both, low);
          w[j][1] = _mm512_and_si512(_mm512_srli_epi16(both, 4), low);
        }
      }
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, b.xq + r * b.k + g * b.group + 4 * q, 4);
        const __m512i a = _mm512_set1_epi32(four);
        for (int j = 0; j < P; ++j) {
          acc[r][j][0] = _mm512_dpbusd_epi32(acc[r][j][0], w[j][0], a);
          acc[r][j][1] = _mm512_dpbusd_epi32(acc[r][j][1], w[j][1], a);
        }
      }
    }
    for (int j = 0; j < P; ++j) {
      const float* scale = reinterpret_cast<const float*>(codes + j * b.panel_bytes + quads * quad_bytes);
      for (int v = 0; v < 2; ++v) {
        const __m512 s = _mm512_loadu_ps(scale + 16 * v);
        const __m512 o = b.offset ? _mm512_loadu_ps(scale + kPanel + 16 * v) : _mm512_setzero_ps();
        for (int r = 0; r < R; ++r) {
          __m512i sum = acc[r][j][v];
          if constexpr (Bits == 8) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * b.xqsum[r * groups + g]));
          const __m512 step = _mm512_mul_ps(s, _mm512_set1_ps(b.dx[r * groups + g]));
          total[r][j][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), step, total[r][j][v]);
          if (b.offset) total[r][j][v] = _mm512_fnmadd_ps(o, _mm512_set1_ps(b.xsum[r * groups + g]), total[r][j][v]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < P; ++j)
      for (int v = 0; v < 2; ++v) _mm512_storeu_ps(b.total + r * P * kPanel + j * kPanel + 16 * v, total[r][j][v]);
}

// Up to 6 rows a block (24 accumulators and totals of the 32 registers); one or two rows take
// four or two panels at once, so that enough independent sums are in flight.
template <int Bits>
void int8_impl(const Rounded& xr, const uint8_t* packed, const float* bias, float* out, int64_t m, int64_t k,
               int64_t n, int64_t group, bool offset) {
  constexpr int64_t max_rows = 6;
  const int64_t stride = group_bytes(group, Bits, offset), panels = (n + kPanel - 1) / kPanel;
  const int64_t groups = k / group, panel_bytes = groups * stride;
  const int64_t wide = m == 1 ? 4 : m == 2 ? 2 : 1;
  // A task's work: VPDPBUSD does 64 products, the float kernels' FMA 16; the grain counts FMAs.
  at::parallel_for(0, panels, std::max<int64_t>(1, panel_grain(m, k) * 4), [&](int64_t begin, int64_t end) {
    alignas(64) float total[max_rows * kPanel * 4];
    for (int64_t p = begin; p < end;) {
      const int64_t count = end - p >= wide ? wide : 1;
      for (int64_t r0 = 0; r0 < m; r0 += max_rows) {
        const int64_t rows = std::min(max_rows, m - r0);
        const Block b{xr.xq.data() + r0 * k, xr.dx.data() + r0 * groups, xr.xqsum.data() + r0 * groups,
                      offset ? xr.xsum.data() + r0 * groups : nullptr, k, packed + p * panel_bytes, panel_bytes,
                      group, stride, offset, total};
        if (count == 4) {
          int8_block<Bits, 1, 4>(b);
        } else if (count == 2) {
          rows == 1 ? int8_block<Bits, 1, 2>(b) : int8_block<Bits, 2, 2>(b);
        } else {
          switch (rows) {
            case 1: int8_block<Bits, 1, 1>(b); break;
            case 2: int8_block<Bits, 2, 1>(b); break;
            case 3: int8_block<Bits, 3, 1>(b); break;
            case 4: int8_block<Bits, 4, 1>(b); break;
            case 5: int8_block<Bits, 5, 1>(b); break;
            default: int8_block<Bits, 6, 1>(b); break;
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
#endif

void check_vnni(const char* name) {
  const auto& isas = runnable_isas();
  TORCH_CHECK(std::find(isas.begin(), isas.end(), "avx512vnni") != isas.end(), name,
              ": this CPU and build have no AVX-512 VNNI; their kernels run on: ", joined(isas));
}

}  // namespace

at::Tensor pack_quantized_int8(at::Tensor q, at::Tensor scale, c10::optional<at::Tensor> offset, int64_t bits) {
  check_vnni("pack_quantized_int8");
  const int64_t group = q.dim() == 2 && scale.dim() == 2 && scale.size(1) > 0 ? q.size(1) / scale.size(1) : 0;
  TORCH_CHECK(group % 4 == 0, "pack_quantized_int8: a group of ", group, " is not whole quads of k");
  // VNNI's layout (above): per quad of k, column j's 4 codes in 4 adjacent bytes.
  return pack_groups(q, scale, offset, bits, [](uint8_t* block, int64_t j, const int8_t* codes, int64_t group,
                                                int64_t bits) {
    for (int64_t i = 0; i < group; ++i) {
      uint8_t* quad = block + (i / 4) * (kPanel * 4 * bits / 8);
      const auto code = static_cast<uint8_t>(codes[i]);
      if (bits == 8)
        quad[4 * j + i % 4] = code ^ 0x80;  // c + 128
      else
        quad[4 * (j % 16) + i % 4] |= j < 16 ? code : uint8_t(code << 4);
    }
  });
}

at::Tensor quantized_int8_rows(at::Tensor packed, at::Tensor rows, int64_t group, int64_t bits) {
  // pack_quantized_int8's layout read back (no VNNI needed to read it).
  return unpack_rows(packed, rows, group, bits, [](const uint8_t* block, int64_t j, int64_t i, int64_t bits) -> int {
    const uint8_t* quad = block + (i / 4) * (kPanel * 4 * bits / 8);
    if (bits == 8) return static_cast<int>(quad[4 * j + i % 4]) - 128;
    const uint8_t byte = quad[4 * (j % 16) + i % 4];
    return j < 16 ? byte & 15 : byte >> 4;
  });
}

at::Tensor quant_linear_int8(at::Tensor x, at::Tensor packed, int64_t n, int64_t group, int64_t bits,
                             c10::optional<at::Tensor> bias) {
  check_vnni("quant_linear_int8");
  x = x.contiguous();
  TORCH_CHECK(group % 4 == 0, "quant_linear_int8: a group of ", group, " is not whole quads of k");
  const bool offset = check_quant_call(x, packed, n, group, bits, bias, "quant_linear_int8", "pack_quantized_int8");
  const auto dtype = x.scalar_type();
  const int64_t m = x.size(0), k = x.size(1);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor bf = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  at::Tensor out = at::empty({m, n}, xf.options());
  if (m == 0) return out.to(dtype);
#if defined(STREAMQ_VNNI)
  const Rounded xr = round_rows(xf.data_ptr<float>(), m, k, group, offset);
  const float* bp = bias ? bf.data_ptr<float>() : nullptr;
  if (bits == 8)
    int8_impl<8>(xr, packed.data_ptr<uint8_t>(), bp, out.data_ptr<float>(), m, k, n, group, offset);
  else
    int8_impl<4>(xr, packed.data_ptr<uint8_t>(), bp, out.data_ptr<float>(), m, k, n, group, offset);
#endif
  return out.to(dtype);
}

}  // namespace streamq
