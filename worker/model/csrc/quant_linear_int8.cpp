// quant_linear_int8: x @ w.T (+ bias) for a weight of 4-, 6- or 8-bit codes (worker/model/quantized.py), with
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
// 0-15 in the low nibbles, 16-31 in the high ones. 6-bit (codes -32..31: Q6_K's, Q5_*'s): 96 bytes
// a quad, the codes + 32 as 4-bit's in 64 bytes of low nibbles, then their top two bits in 32 bytes
// (place_vnni), taken off again as 32 * sum xq; a Q6_K weight then takes 6.6 bits, not 8.6. Then
// 32 scales, then 32 offsets where there are.
//
// Super-blocks (`per` > 0): where each group's scale (and offset) is a small integer times a step
// that `per` consecutive groups share, as llama.cpp's k-quants store them (Q4_K and Q5_K: 8 groups
// of 32 under one fp16 d and dmin, 6-bit integers; Q6_K: 16 groups of 16 under one d, int8), the
// packing keeps per column the shared steps in fp32 and per group its integers in one byte each,
// and the kernel multiplies them back (exact in fp32: an fp16 times an integer below 2^8), so its
// bits are the plain packing's. A Q4_K weight takes 4.75 bits instead of 6, a Q6_K one 8.6 instead
// of 10: a decode step reads that many fewer bytes. Layout [ceil(N / 32), K / group / per,
// SuperLayout's bytes]: 32 steps (then 32 offset steps), then per group its codes (the quads above), 32
// int8 scale integers, then 32 offset integers.
//
// Up to 6 rows a panel's codes are widened in registers as they are read (int8_block). More rows
// (a batch of streams, a prefill) go 48 at a time: a span of 256 of k of a panel is widened to
// bytes once into a buffer that every block of 6 rows then reads (int8_many), so the widening and
// the scales cost once per 48 rows, not per 6. Both run a row's products and folds in one order:
// a row's bits do not depend on how many rows came with it.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "simd.h"

namespace streamq {
namespace {

// Where a super-block's bytes lie: its steps (`head` bytes), then per group its codes (`codes`
// bytes) and one byte a column per integer (`group` bytes in all a group), `bytes` in all.
struct SuperLayout {
  int64_t head, codes, group, bytes;
  SuperLayout(int64_t group_size, int64_t bits, bool offset, int64_t per)
      : head(kPanel * 4 * (offset ? 2 : 1)), codes(group_size * kPanel * bits / 8),
        group(codes + kPanel * (offset ? 2 : 1)), bytes(head + per * group) {}
};

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
  int64_t panel_bytes, group, stride;  // stride: a group's bytes, or a super-block's where per > 0
  bool offset;
  int64_t per;  // groups a super-block, or 0
  float* total;  // [R][P * 32]
};

// What the stored codes carry above the signed ones (VPDPBUSD reads the weight's bytes unsigned).
template <int Bits>
constexpr int32_t kBias = Bits == 8 ? 128 : Bits == 6 ? 32 : 0;

// The 16 scales from `v` * 16 of a group: the plain packing's floats, or step times integer.
inline __m512 scales_at(const uint8_t* floats, const float* steps, int v) {
  if (!steps) return _mm512_loadu_ps(reinterpret_cast<const float*>(floats) + 16 * v);
  const __m512i whole = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(floats + 16 * v)));
  return _mm512_mul_ps(_mm512_loadu_ps(steps + 16 * v), _mm512_cvtepi32_ps(whole));
}

// One quad of a group's codes, 32 columns, as the unsigned bytes VPDPBUSD reads: columns 0-15 in
// `lo`, 16-31 in `hi`, each code + kBias.
template <int Bits>
inline void load_quad(const uint8_t* quad, __m512i& lo, __m512i& hi) {
  if constexpr (Bits == 8) {
    lo = _mm512_loadu_si512(quad);
    hi = _mm512_loadu_si512(quad + 64);
  } else if constexpr (Bits == 6) {  // 64 bytes of low nibbles as 4-bit's, then 32 of top bits
    const __m512i low = _mm512_set1_epi8(0x0F), top_bits = _mm512_set1_epi8(0x30);
    // byte b's top bits at 2 * (b / 32) of top byte b % 32 (low nibbles), 4 more for the high ones
    const __m512i top_low = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i top_high = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    const __m512i both = _mm512_loadu_si512(quad);
    const __m512i top = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(quad + 64)));
    lo = _mm512_or_si512(_mm512_and_si512(both, low),
                         _mm512_and_si512(_mm512_slli_epi16(_mm512_srlv_epi16(top, top_low), 4), top_bits));
    hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(both, 4), low),
                         _mm512_and_si512(_mm512_slli_epi16(_mm512_srlv_epi16(top, top_high), 4), top_bits));
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i both = _mm512_loadu_si512(quad);
    lo = _mm512_and_si512(both, low);
    hi = _mm512_and_si512(_mm512_srli_epi16(both, 4), low);
  }
}

// Where group g's codes start in a panel, and its super-block (null in the plain packing).
struct GroupAt {
  const uint8_t* super;
  const uint8_t* codes;
};

inline GroupAt group_at(const Block& b, const SuperLayout& layout, const uint8_t* panel, int64_t g) {
  if (!b.per) return {nullptr, panel + g * b.stride};
  const uint8_t* super = panel + (g / b.per) * b.stride;
  return {super, super + layout.head + (g % b.per) * layout.group};
}

// A group's 16 scales and offsets of columns 16 v .. 16 v + 15 of one panel (offsets zero where none).
inline void group_scales(const Block& b, const SuperLayout& layout, GroupAt at, int v, __m512& s, __m512& o) {
  const uint8_t* scale = at.codes + layout.codes;
  const float* steps = at.super ? reinterpret_cast<const float*>(at.super) : nullptr;
  const int64_t offsets = at.super ? kPanel : kPanel * 4;  // where a group's offsets follow its scales
  s = scales_at(scale, steps, v);
  o = b.offset ? scales_at(scale + offsets, steps ? steps + kPanel : nullptr, v) : _mm512_setzero_ps();
}

// Row r's group g folded into its float total: the integer sum less the codes' bias, times the
// scale and the row's step, less the offsets times the row's unrounded sum.
inline __m512 fold(const Block& b, int64_t groups, int64_t r, int64_t g, int32_t bias, __m512i sum, __m512 s,
                   __m512 o, __m512 total) {
  if (bias) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(bias * b.xqsum[r * groups + g]));
  const __m512 step = _mm512_mul_ps(s, _mm512_set1_ps(b.dx[r * groups + g]));
  total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), step, total);
  if (b.offset) total = _mm512_fnmadd_ps(o, _mm512_set1_ps(b.xsum[r * groups + g]), total);
  return total;
}

// R rows over P adjacent panels: per group, R x P x 2 int32 accumulators of 16 columns, folded
// into R x P x 2 float totals with the group's scales and offsets.
template <int Bits, int R, int P>
void int8_block(const Block& b) {
  constexpr int64_t quad_bytes = kPanel * 4 * Bits / 8;
  const int64_t groups = b.k / b.group, quads = b.group / 4;
  __m512 total[R][P][2];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < P; ++j) total[r][j][0] = total[r][j][1] = _mm512_setzero_ps();
  const SuperLayout layout(b.group, Bits, b.offset, b.per);  // its codes' bytes a group serve both layouts
  for (int64_t g = 0; g < groups; ++g) {
    GroupAt at[P];
    for (int j = 0; j < P; ++j) at[j] = group_at(b, layout, b.panel + j * b.panel_bytes, g);
    __m512i acc[R][P][2];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < P; ++j) acc[r][j][0] = acc[r][j][1] = _mm512_setzero_si512();
    for (int64_t q = 0; q < quads; ++q) {
      __m512i w[P][2];
      for (int j = 0; j < P; ++j) load_quad<Bits>(at[j].codes + q * quad_bytes, w[j][0], w[j][1]);
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
    for (int j = 0; j < P; ++j)
      for (int v = 0; v < 2; ++v) {
        __m512 s, o;
        group_scales(b, layout, at[j], v, s, o);
        for (int r = 0; r < R; ++r) total[r][j][v] = fold(b, groups, r, g, kBias<Bits>, acc[r][j][v], s, o, total[r][j][v]);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < P; ++j)
      for (int v = 0; v < 2; ++v) _mm512_storeu_ps(b.total + r * P * kPanel + j * kPanel + 16 * v, total[r][j][v]);
}

// Many rows on one panel, a span of groups at a time (kSpan of k, a super-block's 256): the span's
// codes widened to bytes once (`wide`, two vectors a quad) and its scales computed once, then read
// by every block of R rows at r0, whose totals (b.total, kPanel a row) stay in registers over the
// span. The same operations a row and column as int8_block's, in the same order.
constexpr int64_t kSpan = 256;

template <int Bits, int R>
void int8_rows(const Block& b, const uint8_t* wide, const __m512* so, int64_t g0, int64_t span, int64_t r0) {
  const int64_t groups = b.k / b.group, quads = b.group / 4;
  __m512 total[R][2];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v) total[r][v] = _mm512_load_ps(b.total + (r0 + r) * kPanel + 16 * v);
  for (int64_t i = 0; i < span; ++i) {
    const int64_t g = g0 + i;
    __m512i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    for (int64_t q = 0; q < quads; ++q) {
      const uint8_t* quad = wide + (i * quads + q) * 128;
      const __m512i lo = _mm512_load_si512(quad), hi = _mm512_load_si512(quad + 64);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, b.xq + (r0 + r) * b.k + g * b.group + 4 * q, 4);
        const __m512i a = _mm512_set1_epi32(four);
        acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], lo, a);
        acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], hi, a);
      }
    }
    for (int v = 0; v < 2; ++v)  // so: per group its scales then its offsets, two vectors each
      for (int r = 0; r < R; ++r)
        total[r][v] = fold(b, groups, r0 + r, g, kBias<Bits>, acc[r][v], so[i * 4 + v], so[i * 4 + 2 + v], total[r][v]);
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 2; ++v) _mm512_store_ps(b.total + (r0 + r) * kPanel + 16 * v, total[r][v]);
}

// `rows` rows (at most kManyRows) on one panel, their totals in b.total (64-byte aligned).
constexpr int64_t kManyRows = 48;

template <int Bits>
void int8_many(const Block& b, int64_t rows) {
  constexpr int64_t quad_bytes = kPanel * 4 * Bits / 8;
  const int64_t groups = b.k / b.group, quads = b.group / 4, span = std::max<int64_t>(1, kSpan / b.group);
  const SuperLayout layout(b.group, Bits, b.offset, b.per);
  alignas(64) uint8_t wide[kSpan / 4 * 128];  // a span's quads, two vectors each (a group of 128: two groups)
  __m512 so[kSpan / 16 * 4];  // the span's groups' scales and offsets (groups of 16: 16 of them)
  std::fill(b.total, b.total + rows * kPanel, 0.0f);
  for (int64_t g0 = 0; g0 < groups; g0 += span) {
    const int64_t count = std::min(span, groups - g0);
    for (int64_t i = 0; i < count; ++i) {
      const GroupAt at = group_at(b, layout, b.panel, g0 + i);
      for (int64_t q = 0; q < quads; ++q) {
        __m512i lo, hi;
        load_quad<Bits>(at.codes + q * quad_bytes, lo, hi);
        _mm512_store_si512(wide + (i * quads + q) * 128, lo);
        _mm512_store_si512(wide + (i * quads + q) * 128 + 64, hi);
      }
      for (int v = 0; v < 2; ++v) group_scales(b, layout, at, v, so[i * 4 + v], so[i * 4 + 2 + v]);
    }
    int64_t r0 = 0;
    for (; r0 + 6 <= rows; r0 += 6) int8_rows<Bits, 6>(b, wide, so, g0, count, r0);
    switch (rows - r0) {
      case 1: int8_rows<Bits, 1>(b, wide, so, g0, count, r0); break;
      case 2: int8_rows<Bits, 2>(b, wide, so, g0, count, r0); break;
      case 3: int8_rows<Bits, 3>(b, wide, so, g0, count, r0); break;
      case 4: int8_rows<Bits, 4>(b, wide, so, g0, count, r0); break;
      case 5: int8_rows<Bits, 5>(b, wide, so, g0, count, r0); break;
      default: break;
    }
  }
}

// Up to 6 rows a block (24 accumulators and totals of the 32 registers); one or two rows take
// four or two panels at once, so that enough independent sums are in flight. More rows than a
// block go by int8_many, kManyRows at a time: a group's codes widened once for all of them.
template <int Bits>
void int8_impl(const Rounded& xr, const uint8_t* packed, const float* bias, float* out, int64_t m, int64_t k,
               int64_t n, int64_t group, bool offset, int64_t per) {
  constexpr int64_t max_rows = 6;
  const int64_t groups = k / group, panels = (n + kPanel - 1) / kPanel;
  const int64_t stride = per ? SuperLayout(group, Bits, offset, per).bytes : group_bytes(group, Bits, offset);
  const int64_t panel_bytes = (per ? groups / per : groups) * stride;
  const int64_t wide = m == 1 ? 4 : m == 2 ? 2 : 1;
  const int64_t chunk = m > max_rows ? kManyRows : max_rows;
  // A task's work: VPDPBUSD does 64 products, the float kernels' FMA 16; the grain counts FMAs.
  at::parallel_for(0, panels, std::max<int64_t>(1, panel_grain(m, k) * 4), [&](int64_t begin, int64_t end) {
    alignas(64) float total[kManyRows * kPanel];
    for (int64_t p = begin; p < end;) {
      const int64_t count = end - p >= wide ? wide : 1;
      for (int64_t r0 = 0; r0 < m; r0 += chunk) {
        const int64_t rows = std::min(chunk, m - r0);
        const Block b{xr.xq.data() + r0 * k, xr.dx.data() + r0 * groups, xr.xqsum.data() + r0 * groups,
                      offset ? xr.xsum.data() + r0 * groups : nullptr, k, packed + p * panel_bytes, panel_bytes,
                      group, stride, offset, per, total};
        if (m > max_rows) {
          int8_many<Bits>(b, rows);
        } else if (count == 4) {
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

// VNNI's layout (above): per quad of k, column j's 4 codes in 4 adjacent bytes. 6-bit codes (c + 32)
// as 4-bit ones (their low nibbles: byte b = 4 (j % 16) + i % 4, column j >= 16 in its high nibble),
// then 32 bytes of their top two bits: byte b's in top byte b % 32, at bit 2 (b / 32), plus 4 for
// the high nibble's column.
void place_vnni(uint8_t* block, int64_t j, const int8_t* codes, int64_t group, int64_t bits) {
  for (int64_t i = 0; i < group; ++i) {
    uint8_t* quad = block + (i / 4) * (kPanel * 4 * bits / 8);
    const auto code = static_cast<uint8_t>(codes[i]);
    const int64_t b = 4 * (j % 16) + i % 4;
    if (bits == 8) {
      quad[4 * j + i % 4] = code ^ 0x80;  // c + 128
    } else if (bits == 6) {
      const auto stored = static_cast<uint8_t>(codes[i] + 32);
      quad[b] |= j < 16 ? stored & 15 : uint8_t((stored & 15) << 4);
      quad[64 + b % 32] |= uint8_t((stored >> 4) << (2 * (b / 32) + (j < 16 ? 0 : 4)));
    } else {
      quad[b] |= j < 16 ? code : uint8_t(code << 4);
    }
  }
}

int read_vnni(const uint8_t* block, int64_t j, int64_t i, int64_t bits) {
  const uint8_t* quad = block + (i / 4) * (kPanel * 4 * bits / 8);
  if (bits == 8) return static_cast<int>(quad[4 * j + i % 4]) - 128;
  const int64_t b = 4 * (j % 16) + i % 4;
  const int nibble = j < 16 ? quad[b] & 15 : quad[b] >> 4;
  if (bits == 4) return nibble;
  const int top = (quad[64 + b % 32] >> (2 * (b / 32) + (j < 16 ? 0 : 4))) & 3;
  return nibble + 16 * top - 32;
}

// `value` as a whole multiple of `step` in int8, exactly (a k-quant's scale is its fp16 step times
// a 6- or 8-bit integer), or an error naming what does not fit.
int8_t whole(float value, float step, const char* what) {
  if (step == 0.0f) {
    TORCH_CHECK(value == 0.0f, "pack_quantized_int8: a ", what, " of ", value, " under a step of 0");
    return 0;
  }
  const float i = std::nearbyint(value / step);
  TORCH_CHECK(i >= -128.0f && i <= 127.0f && i * step == value, "pack_quantized_int8: the ", what, " ", value,
              " is not a whole multiple (-128..127) of its step ", step);
  return static_cast<int8_t>(i);
}

// The super-block packing (above): the groups' codes as pack_groups places them, their scales and
// offsets as int8 multiples of the per-column steps.
at::Tensor pack_super(const at::Tensor& q, const at::Tensor& scale, const c10::optional<at::Tensor>& offset,
                      int64_t bits, const at::Tensor& steps, const c10::optional<at::Tensor>& offset_steps) {
  check_rows(steps, "steps");
  TORCH_CHECK(steps.scalar_type() == at::kFloat && steps.size(0) == q.size(0) && steps.size(1) > 0 &&
                  scale.size(1) % steps.size(1) == 0, "pack_quantized_int8: steps must be float32 [N, groups / per]");
  TORCH_CHECK(offset.has_value() == offset_steps.has_value(),
              "pack_quantized_int8: offsets and their steps go together");
  if (offset_steps) {
    check_rows(*offset_steps, "offset_steps");
    TORCH_CHECK(offset_steps->sizes() == steps.sizes() && offset_steps->scalar_type() == at::kFloat,
                "pack_quantized_int8: offset_steps must match steps");
  }
  const int64_t n = q.size(0), k = q.size(1), groups = scale.size(1), group = k / groups, supers = steps.size(1);
  const int64_t per = groups / supers, panels = (n + kPanel - 1) / kPanel;
  const bool has_offset = offset.has_value();
  const SuperLayout layout(group, bits, has_offset, per);
  const int64_t stride = layout.bytes;
  at::Tensor packed = at::zeros({panels, supers, stride}, q.options().dtype(at::kByte));
  const int8_t* qp = q.data_ptr<int8_t>();
  const float *sp = scale.data_ptr<float>(), *tp = steps.data_ptr<float>();
  const float* op = has_offset ? offset->data_ptr<float>() : nullptr;
  const float* up = has_offset ? offset_steps->data_ptr<float>() : nullptr;
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, panels * supers, 1, [&](int64_t begin, int64_t end) {  // throws the first error
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = item / supers, s = item % supers, columns = std::min<int64_t>(kPanel, n - p * kPanel);
      uint8_t* block = dst + item * stride;
      float* floats = reinterpret_cast<float*>(block);
      for (int64_t j = 0; j < columns; ++j) {
        const int64_t row = p * kPanel + j;
        floats[j] = tp[row * supers + s];
        if (has_offset) floats[kPanel + j] = up[row * supers + s];
        for (int64_t i = 0; i < per; ++i) {
          const int64_t g = s * per + i;
          uint8_t* gb = block + layout.head + i * layout.group;
          place_vnni(gb, j, qp + row * k + g * group, group, bits);
          gb[layout.codes + j] = static_cast<uint8_t>(whole(sp[row * groups + g], floats[j], "scale"));
          if (has_offset)
            gb[layout.codes + kPanel + j] =
                static_cast<uint8_t>(whole(op[row * groups + g], floats[kPanel + j], "offset"));
        }
      }
    }
  });
  return packed;
}

// Whether `packed` is the super-block packing of a weight [n, k] in groups of `group`, `per` a
// super-block; whether it has offsets.
bool check_super(const at::Tensor& packed, int64_t n, int64_t k, int64_t group, int64_t bits, int64_t per,
                 const char* name) {
  TORCH_CHECK((bits == 4 || bits == 6 || bits == 8) && group > 0 && group % 4 == 0 && per > 0, name,
              ": bits 4, 6 or 8, group a multiple of 4, per > 0");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == (n + kPanel - 1) / kPanel && packed.size(1) * per * group == k,
              name, ": packed must be pack_quantized_int8's super-blocks of a weight [n, K] in groups of ", group);
  const bool offset = packed.size(2) == SuperLayout(group, bits, true, per).bytes;
  TORCH_CHECK(offset || packed.size(2) == SuperLayout(group, bits, false, per).bytes, name, ": packed is not ", bits,
              "-bit in groups of ", group, ", ", per, " a super-block");
  return offset;
}

}  // namespace

at::Tensor pack_quantized_int8(at::Tensor q, at::Tensor scale, c10::optional<at::Tensor> offset, int64_t bits,
                               c10::optional<at::Tensor> steps, c10::optional<at::Tensor> offset_steps) {
  check_vnni("pack_quantized_int8");
  const int64_t group = q.dim() == 2 && scale.dim() == 2 && scale.size(1) > 0 ? q.size(1) / scale.size(1) : 0;
  TORCH_CHECK(group % 4 == 0, "pack_quantized_int8: a group of ", group, " is not whole quads of k");
  if (!steps) return pack_groups(q, scale, offset, bits, place_vnni);
  check_pack(q, scale, offset, bits);
  return pack_super(q, scale, offset, bits, *steps, offset_steps);
}

at::Tensor quantized_int8_rows(at::Tensor packed, at::Tensor rows, int64_t group, int64_t bits, int64_t per) {
  // pack_quantized_int8's layout read back (no VNNI needed to read it).
  if (!per) return unpack_rows(packed, rows, group, bits, read_vnni);
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "rows: int64 [T]");
  const int64_t n = packed.size(0) * kPanel, k = packed.size(1) * per * group;
  const bool offset = check_super(packed, n, k, group, bits, per, "quantized_int8_rows");
  const int64_t supers = packed.size(1), stride = packed.size(2);
  const SuperLayout layout(group, bits, offset, per);
  const at::Tensor index = rows.contiguous();
  const int64_t* rp = index.data_ptr<int64_t>();
  const int64_t t = index.numel();
  for (int64_t r = 0; r < t; ++r) TORCH_CHECK(rp[r] >= 0 && rp[r] < n, "row ", rp[r], " is out of range");
  at::Tensor out = at::empty({t, k}, packed.options().dtype(at::kFloat));
  const uint8_t* src = packed.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, t, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t p = rp[r] / kPanel, j = rp[r] % kPanel;
      for (int64_t s = 0; s < supers; ++s) {
        const uint8_t* block = src + (p * supers + s) * stride;
        const float* floats = reinterpret_cast<const float*>(block);
        for (int64_t i = 0; i < per; ++i) {
          const uint8_t* gb = block + layout.head + i * layout.group;
          const float scale = floats[j] * static_cast<float>(static_cast<int8_t>(gb[layout.codes + j]));
          const float shift = offset ? floats[kPanel + j] * static_cast<float>(static_cast<int8_t>(
                                                                gb[layout.codes + kPanel + j]))
                                     : 0.0f;
          float* w = dst + r * k + (s * per + i) * group;
          for (int64_t c = 0; c < group; ++c) w[c] = static_cast<float>(read_vnni(gb, j, c, bits)) * scale - shift;
        }
      }
    }
  });
  return out;
}

at::Tensor quant_linear_int8(at::Tensor x, at::Tensor packed, int64_t n, int64_t group, int64_t bits,
                             c10::optional<at::Tensor> bias, int64_t per) {
  check_vnni("quant_linear_int8");
  x = x.contiguous();
  TORCH_CHECK(group % 4 == 0 && group <= 128, "quant_linear_int8: a group of ", group,
              " is not whole quads of k, at most 128");
  bool offset;
  if (per) {
    check_rows(x, "x");
    TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "quant_linear_int8: x float32 or "
                "bfloat16");
    offset = check_super(packed, n, x.size(1), group, bits, per, "quant_linear_int8");
    if (bias) TORCH_CHECK(bias->is_contiguous() && bias->numel() == n, "bad bias");
  } else {
    offset = check_quant_call(x, packed, n, group, bits, bias, "quant_linear_int8", "pack_quantized_int8");
  }
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
    int8_impl<8>(xr, packed.data_ptr<uint8_t>(), bp, out.data_ptr<float>(), m, k, n, group, offset, per);
  else if (bits == 6)
    int8_impl<6>(xr, packed.data_ptr<uint8_t>(), bp, out.data_ptr<float>(), m, k, n, group, offset, per);
  else
    int8_impl<4>(xr, packed.data_ptr<uint8_t>(), bp, out.data_ptr<float>(), m, k, n, group, offset, per);
#endif
  return out.to(dtype);
}

}  // namespace streamq
