// panel_linear: a projection x @ w.T (+ bias) over a weight packed once in panels of 32 output
// columns, each contiguous: fp32 on AVX-512 and on AVX2, bf16 on AVX512-BF16.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstring>

#include "simd.h"

namespace streamq {
namespace {

#if defined(STREAMQ_AVX512)
// Projections for the few rows of a decode step (1 to 64 tokens). A step streams every weight
// from memory once, and at these row counts oneDNN's kernels reach 13-17 GB/s in fp32: they read
// a stretch of weight, then compute on it, and do not overlap the two. Here the weight is packed
// once into panels of 32 output columns, each contiguous; a block of up to 12 rows keeps 12 x 2
// accumulators in registers over the whole K, and while the second block of rows computes on a
// panel (from L2 by then) the next panel is prefetched. Every output is one running fp32 sum over
// k in order: fused multiply-adds in fp32; in bf16 the CPU's bf16 dot product of k-pairs (exact
// products, fp32 sums), rounded to bf16 once at the end, after the bias.
//   fp32 panels: [ceil(N / 32), K, 32]        bf16 panels: [ceil(N / 32), ceil(K / 2), 32, 2]
constexpr int kPanelRows = 12;

inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? __mmask16(0xFFFF) : count <= 0 ? __mmask16(0) : __mmask16((1u << count) - 1);
}

inline void prefetch_lines(const void* at) {
  _mm_prefetch(reinterpret_cast<const char*>(at), _MM_HINT_T1);
  _mm_prefetch(reinterpret_cast<const char*>(at) + 64, _MM_HINT_T1);
}

// One step of k (fp32) or of a k-pair (bf16) for R rows: acc[r] += x[r] * panel row.
template <typename T, int R> struct PanelStep;

template <int R> struct PanelStep<float, R> {
  static constexpr int64_t kWidth = 1;  // k per step
  static void run(__m512 (&acc)[R][2], const float* x, int64_t k_total, int64_t step, const float* row, bool) {
    const __m512 b0 = _mm512_loadu_ps(row), b1 = _mm512_loadu_ps(row + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * k_total + step]);
      acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
    }
  }
};

#if defined(STREAMQ_AVX512) && defined(__AVX512BF16__)
template <int R> struct PanelStep<c10::BFloat16, R> {
  static constexpr int64_t kWidth = 2;
  static void run(__m512 (&acc)[R][2], const c10::BFloat16* x, int64_t k_total, int64_t step, const c10::BFloat16* row,
                  bool half) {  // half: K is odd and this is its last, lone k
    const __m512i b0 = _mm512_loadu_si512(row), b1 = _mm512_loadu_si512(row + 32);
    for (int r = 0; r < R; ++r) {
      const uint16_t* xr = reinterpret_cast<const uint16_t*>(x + r * k_total + 2 * step);
      int32_t pair = xr[0];
      if (!half) pair |= int32_t(xr[1]) << 16;
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, (__m512bh)b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, (__m512bh)b1);
    }
  }
};
#endif

inline void store_panel_row(float* out, __m512 lo, __m512 hi, int64_t left) {
  _mm512_mask_storeu_ps(out, first_lanes(left), lo);
  _mm512_mask_storeu_ps(out + 16, first_lanes(left - 16), hi);
}

#if defined(STREAMQ_AVX512) && defined(__AVX512BF16__)
inline void store_panel_row(c10::BFloat16* out, __m512 lo, __m512 hi, int64_t left) {
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(lo)),
                                          (__m256i)_mm512_cvtneps_pbh(hi), 1);
  const __mmask32 lanes = left >= 32 ? ~__mmask32(0) : __mmask32((uint64_t{1} << left) - 1);
  _mm512_mask_storeu_epi16(out, lanes, both);
}
#endif

inline __m512 load_bias(const float* bias, int64_t left) { return _mm512_maskz_loadu_ps(first_lanes(left), bias); }

#if defined(STREAMQ_AVX512) && defined(__AVX512BF16__)
inline __m512 load_bias(const c10::BFloat16* bias, int64_t left) {
  const __m256i raw = _mm256_maskz_loadu_epi16(first_lanes(left), bias);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

template <typename T, int R>
void panel_block(const T* x, int64_t k_total, const T* panel, const T* next, bool prefetch, const T* bias,
                 int64_t left, T* out, int64_t n_total) {
  using Step = PanelStep<T, R>;
  constexpr int64_t row = kPanel * Step::kWidth;  // elements of one panel row
  const int64_t steps = (k_total + Step::kWidth - 1) / Step::kWidth;
  const bool odd = k_total % Step::kWidth != 0;
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t i = 0; i < steps; ++i) {
    if (prefetch) prefetch_lines(next + i * row);  // the next panel's lines for this step
    Step::run(acc, x, k_total, i, panel + i * row, odd && i == steps - 1);
  }
  for (int r = 0; r < R; ++r) {
    __m512 lo = acc[r][0], hi = acc[r][1];
    if (bias) lo = _mm512_add_ps(lo, load_bias(bias, left)), hi = _mm512_add_ps(hi, load_bias(bias + 16, left - 16));
    store_panel_row(out + r * n_total, lo, hi, left);
  }
}

template <typename T>
void panel_linear_impl(const T* xp, const T* pp, const T* bp, T* op, int64_t m, int64_t k, int64_t n, int64_t panels,
                       int64_t panel_elems) {
  at::parallel_for(0, panels, panel_grain(m, k), [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPanel, left = n - n0;
      const T* panel = pp + p * panel_elems;
      const T* next = p + 1 < end ? panel + panel_elems : panel;
      for (int64_t r0 = 0, block = 0; r0 < m; r0 += kPanelRows, ++block) {
        // The first block of rows reads the panel from memory; the second, computing from L2,
        // prefetches the next (with one block only, that one does).
        const bool prefetch = block == 1 || m <= kPanelRows;
        const T* xr = xp + r0 * k;
        const T* b = bp ? bp + n0 : nullptr;
        T* o = op + r0 * n + n0;
        switch (std::min<int64_t>(kPanelRows, m - r0)) {
#define STREAMQ_PANEL_ROWS(R) \
  case R: panel_block<T, R>(xr, k, panel, next, prefetch, b, left, o, n); break;
          STREAMQ_PANEL_ROWS(1) STREAMQ_PANEL_ROWS(2) STREAMQ_PANEL_ROWS(3) STREAMQ_PANEL_ROWS(4)
          STREAMQ_PANEL_ROWS(5) STREAMQ_PANEL_ROWS(6) STREAMQ_PANEL_ROWS(7) STREAMQ_PANEL_ROWS(8)
          STREAMQ_PANEL_ROWS(9) STREAMQ_PANEL_ROWS(10) STREAMQ_PANEL_ROWS(11) STREAMQ_PANEL_ROWS(12)
#undef STREAMQ_PANEL_ROWS
        }
      }
    }
  });
}
#endif


#if defined(STREAMQ_AVX2)
// The AVX2 form of the fp32 kernel, 8 lanes: 16 registers hold 12 accumulators, so a block of
// two rows covers the panel's 32 columns (4 vectors) at once, one row two panels (8 sums in
// flight hide the FMA's latency), and 3 to 6 rows cover it in two passes of 16 (the second from
// cache). Every lane is the same sum as in the AVX-512 kernel: FMAs over k in order, then the bias.
template <int R, int P, int V>  // P > 1 with R == 1 only
void avx2_panel_block(const float* x, int64_t k, const float* panel, int v0, const float* bias, int64_t left,
                      float* out, int64_t n) {
  using S = Avx2;
  S::F acc[R][P][V];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < P; ++j)
      for (int v = 0; v < V; ++v) acc[r][j][v] = S::zero();
  for (int64_t i = 0; i < k; ++i) {
    if constexpr (P == 1) {  // the panel row's vectors in registers, then a row at a time
      S::F w[V];
      for (int v = 0; v < V; ++v) w[v] = S::load(panel + i * kPanel + (v0 + v) * S::kWidth);
      for (int r = 0; r < R; ++r) {
        const S::F a = S::broadcast(x[r * k + i]);
        for (int v = 0; v < V; ++v) acc[r][0][v] = S::fma(a, w[v], acc[r][0][v]);
      }
    } else {  // one row (R == 1), a vector of a panel at a time
      const S::F a = S::broadcast(x[i]);
      for (int j = 0; j < P; ++j)
        for (int v = 0; v < V; ++v)
          acc[0][j][v] = S::fma(a, S::load(panel + (j * k + i) * kPanel + (v0 + v) * S::kWidth), acc[0][j][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < P; ++j)
      store_columns<S>(out + r * n + j * kPanel, acc[r][j], v0, V, bias ? bias + j * kPanel : nullptr,
                       left - j * kPanel);
}

void avx2_panel_linear(const float* xp, const float* pp, const float* bp, float* op, int64_t m, int64_t k, int64_t n,
                       int64_t panels) {
  at::parallel_for(0, panels, panel_grain(m, k), [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end;) {
      const int64_t count = m == 1 && end - p >= 2 ? 2 : 1;
      const int64_t n0 = p * kPanel, left = n - n0;
      const float* panel = pp + p * k * kPanel;
      const float* b = bp ? bp + n0 : nullptr;
      for (int64_t r0 = 0; r0 < m;) {
        const int64_t rows = std::min<int64_t>(m - r0, 6);
        const float* xr = xp + r0 * k;
        float* o = op + r0 * n + n0;
        switch (count == 2 ? 0 : rows) {
          case 0: avx2_panel_block<1, 2, 4>(xr, k, panel, 0, b, left, o, n); break;
          case 1: avx2_panel_block<1, 1, 4>(xr, k, panel, 0, b, left, o, n); break;
          case 2: avx2_panel_block<2, 1, 4>(xr, k, panel, 0, b, left, o, n); break;
#define STREAMQ_TWO_PASSES(R)                                      \
  case R:                                                          \
    avx2_panel_block<R, 1, 2>(xr, k, panel, 0, b, left, o, n); \
    avx2_panel_block<R, 1, 2>(xr, k, panel, 2, b, left, o, n); \
    break;
          STREAMQ_TWO_PASSES(3) STREAMQ_TWO_PASSES(4) STREAMQ_TWO_PASSES(5) STREAMQ_TWO_PASSES(6)
#undef STREAMQ_TWO_PASSES
        }
        r0 += rows;
      }
      p += count;
    }
  });
}
#endif

}  // namespace

// The dtypes panel_linear computes on `isa`: fp32 on both, bf16 on AVX-512 with AVX512-BF16.
bool panels_for(at::ScalarType dtype, Isa isa) {
#if defined(STREAMQ_AVX512) && defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return isa == Isa::kAvx512;
#endif
  return dtype == at::kFloat;
}

std::vector<std::string> panel_dtypes(const std::string& isa) {
  if (runnable_isas().empty()) return {};
  const Isa chosen = float_isa(choose_isa(isa));
  std::vector<std::string> out{"float32"};
  if (panels_for(at::kBFloat16, chosen)) out.push_back("bfloat16");
  return out;
}

// w [N, K] -> its panels (the layout above), the columns past N and a bf16 lone last k zero.
at::Tensor pack_panels(at::Tensor w) {
  check_rows(w, "w");
  TORCH_CHECK(!runnable_isas().empty() && panels_for(w.scalar_type(), float_isa(choose_isa("auto"))),
              "pack_panels: this CPU has no panel_linear for ", w.scalar_type());
  const int64_t n = w.size(0), k = w.size(1), panels = (n + 31) / 32, width = w.scalar_type() == at::kFloat ? 1 : 2;
  const int64_t steps = (k + width - 1) / width;
  at::Tensor packed = at::zeros(width == 1 ? std::vector<int64_t>{panels, k, 32} : std::vector<int64_t>{panels, steps, 32, 2},
                                w.options());
  const auto elem = w.element_size();
  const char* src = static_cast<const char*>(w.data_ptr());
  char* dst = static_cast<char*>(packed.data_ptr());
  at::parallel_for(0, panels, panel_grain(1, k), [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < 32 && p * 32 + j < n; ++j)
        for (int64_t i = 0; i < k; ++i)
          std::memcpy(dst + (((p * steps + i / width) * 32 + j) * width + i % width) * elem,
                      src + ((p * 32 + j) * k + i) * elem, elem);
  });
  return packed;
}

// x [M, K] @ w.T (+ bias), w given as pack_panels(w) and its row count N; fp32 or bf16.
at::Tensor panel_linear(at::Tensor x, at::Tensor panels, int64_t n, c10::optional<at::Tensor> bias,
                        const std::string& isa) {
  x = x.contiguous();
  check_rows(x, "x");
  const auto dtype = x.scalar_type();
  const Isa chosen = float_isa(choose_isa(isa));
  TORCH_CHECK(panels_for(dtype, chosen) && panels.scalar_type() == dtype, "panel_linear: x and the panels in one "
              "dtype the '", isa, "' kernels compute them in");
  const int64_t m = x.size(0), k = x.size(1), width = dtype == at::kFloat ? 1 : 2;
  TORCH_CHECK(panels.is_contiguous() && panels.dim() == (width == 1 ? 3 : 4) && panels.size(0) == (n + 31) / 32 &&
              panels.size(1) == (k + width - 1) / width && panels.size(2) == 32,
              "panel_linear: panels must be pack_panels(w) of w [n, K]");
  if (bias) TORCH_CHECK(bias->is_contiguous() && bias->numel() == n && bias->scalar_type() == dtype, "bad bias");
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
#if defined(STREAMQ_AVX512)
  const int64_t panel_elems = panels.numel() / panels.size(0);
  if (chosen == Isa::kAvx512 && dtype == at::kFloat)
    panel_linear_impl<float>(x.data_ptr<float>(), panels.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr,
                             out.data_ptr<float>(), m, k, n, panels.size(0), panel_elems);
#endif
#if defined(STREAMQ_AVX512) && defined(__AVX512BF16__)
  if (chosen == Isa::kAvx512 && dtype == at::kBFloat16)
    panel_linear_impl<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), panels.data_ptr<c10::BFloat16>(),
                                     bias ? bias->data_ptr<c10::BFloat16>() : nullptr, out.data_ptr<c10::BFloat16>(),
                                     m, k, n, panels.size(0), panel_elems);
#endif
#if defined(STREAMQ_AVX2)
  if (chosen == Isa::kAvx2)
    avx2_panel_linear(x.data_ptr<float>(), panels.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr,
                      out.data_ptr<float>(), m, k, n, panels.size(0));
#endif
  return out;
}

}  // namespace streamq
