// The built-in engine's CPU step kernels: the parts of a llama-family layer between its matmuls.
//
// In eager torch a decode layer of a small model is ~70 tensor ops, most of them elementwise on
// a few KB, so the calls cost more than the arithmetic. These kernels do each stretch in one
// call, and attention reads the paged KV cache in place (no gathered copy of the context):
//   add_rms_norm   residual add and RMSNorm            (transformers' LlamaRMSNorm, op for op)
//   rope_cache     rotary on q and k, k and v written to their cache slots
//   paged_attention each query token over its sequence's cached keys, through the block table
//   panel_linear   a projection over a weight packed in 32-column panels (AVX-512; bf16: AVX512-BF16)
//
// Each follows the eager ops' roundings where it is cheap to (a bf16 result is rounded where the
// eager op would round it), so fp32 and bf16 results stay close to the modules'; sums run in
// fp32 in another order. Compiled at first use for this CPU (worker/kernels.py), with
// -ffp-contract=off so that a*b + c*d is not fused into a different rounding.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

template <typename T> inline T round_to(float x);
template <> inline float round_to<float>(float x) { return x; }
template <> inline c10::BFloat16 round_to<c10::BFloat16>(float x) { return c10::BFloat16(x); }

// x rounded to T and back: the value an eager op in dtype T would have stored.
template <typename T> inline float as_stored(float x) { return to_float(round_to<T>(x)); }

// e^x for x <= 0 (softmax after the max is taken off), vectorisable: Cody-Waite range reduction
// and a degree-6 polynomial, within 2 ulp of expf; below e^-87 it returns ~1e-38, not 0.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  float n = (x * 1.44269504088896341f + shifter) - shifter;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * (r * r) + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  return y * __builtin_bit_cast(float, bits);
}

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// Rows per parallel task: a few KB of work each, so a one-token step runs on the calling thread.
inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(1, row_elems)); }

template <typename T>
void add_rms_norm_impl(at::Tensor& h, const at::Tensor* y, const at::Tensor& w, at::Tensor& out, double eps) {
  const int64_t rows = h.size(0), n = h.size(1);
  T* hp = h.data_ptr<T>();
  const T* yp = y ? y->data_ptr<T>() : nullptr;
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(n), wf(n);
    load_row(wp, wf.data(), n);
    for (int64_t r = begin; r < end; ++r) {
      T* hr = hp + r * n;
      float ss = 0.0f;
      if (yp) {
        const T* yr = yp + r * n;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; ++i) {
          float v = as_stored<T>(to_float(hr[i]) + to_float(yr[i]));  // h = h + y, in T
          buf[i] = v;
          ss += v * v;
        }
        for (int64_t i = 0; i < n; ++i) hr[i] = round_to<T>(buf[i]);
      } else {
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < n; ++i) {
          float v = to_float(hr[i]);
          buf[i] = v;
          ss += v * v;
        }
      }
      // LlamaRMSNorm: h * rsqrt(mean(h^2) + eps) in fp32, cast to T, times the weight in T.
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + feps);
      T* orow = op + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) orow[i] = round_to<T>(wf[i] * as_stored<T>(buf[i] * inv));
    }
  });
}

// Calls f with a value of the C++ type of `dtype` (float or c10::BFloat16): the kernels' one dispatch.
template <typename F>
void float_or_bfloat16(at::ScalarType dtype, const char* name, F&& f) {
  if (dtype == at::kFloat) {
    f(float{});
  } else if (dtype == at::kBFloat16) {
    f(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, name, ": float32 or bfloat16 only");
  }
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.dim() == 2, name, " must be a contiguous 2-d CPU tensor");
}

// out = rms_norm(h + y) with h updated in place to h + y; y may be None (out = rms_norm(h)).
at::Tensor add_rms_norm(at::Tensor h, c10::optional<at::Tensor> y, at::Tensor w, double eps) {
  check_rows(h, "h");
  TORCH_CHECK(w.is_contiguous() && w.numel() == h.size(1) && w.scalar_type() == h.scalar_type(), "bad norm weight");
  if (y) {
    check_rows(*y, "y");
    TORCH_CHECK(y->sizes() == h.sizes() && y->scalar_type() == h.scalar_type(), "y must match h");
  }
  at::Tensor out = at::empty_like(h);
  const at::Tensor* yp = y ? &*y : nullptr;
  float_or_bfloat16(h.scalar_type(), "add_rms_norm",
                    [&](auto type) { add_rms_norm_impl<decltype(type)>(h, yp, w, out, eps); });
  return out;
}

// transformers' apply_rotary_pos_emb on one head: x * cos + rotate_half(x) * sin, each product
// and the sum rounded to T as the eager ops round them.
template <typename T>
inline void rotate(const T* x, const float* c, const float* s, T* out, int64_t dim) {
  const int64_t half = dim / 2;
#pragma omp simd
  for (int64_t d = 0; d < half; ++d) {
    float a = as_stored<T>(to_float(x[d]) * c[d]);
    float b = as_stored<T>(-to_float(x[d + half]) * s[d]);
    out[d] = round_to<T>(a + b);
  }
#pragma omp simd
  for (int64_t d = half; d < dim; ++d) {
    float a = as_stored<T>(to_float(x[d]) * c[d]);
    float b = as_stored<T>(to_float(x[d - half]) * s[d]);
    out[d] = round_to<T>(a + b);
  }
}

template <typename T>
void rope_cache_impl(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                     at::Tensor& k_cache, at::Tensor& v_cache, at::Tensor& q, int64_t heads, int64_t kv_heads) {
  const int64_t tokens = qkv.size(0), width = qkv.size(1), dim = cos.size(1);
  const int64_t cache_slots = k_cache.size(1);
  const T* src = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  T* qp = q.data_ptr<T>();
  at::parallel_for(0, tokens, grain(width), [&](int64_t begin, int64_t end) {
    std::vector<float> c(dim), s(dim);
    for (int64_t t = begin; t < end; ++t) {
      load_row(cp + t * dim, c.data(), dim);
      load_row(sp + t * dim, s.data(), dim);
      const T* row = src + t * width;
      for (int64_t h = 0; h < heads; ++h) rotate(row + h * dim, c.data(), s.data(), qp + (t * heads + h) * dim, dim);
      const int64_t at_slot = slot[t];
      for (int64_t h = 0; h < kv_heads; ++h) {
        T* kdst = kc + (h * cache_slots + at_slot) * dim;
        rotate(row + (heads + h) * dim, c.data(), s.data(), kdst, dim);
        const T* v = row + (heads + kv_heads + h) * dim;
        T* vdst = vc + (h * cache_slots + at_slot) * dim;
        for (int64_t d = 0; d < dim; ++d) vdst[d] = v[d];
      }
    }
  });
}

// qkv [T, (H + 2 Hkv) D] -> rotated q [T, H, D]; rotated k and v written to the layer's cache
// [Hkv, slots, D] at each token's slot. cos and sin: [T, D].
at::Tensor rope_cache(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor slots, at::Tensor k_cache,
                      at::Tensor v_cache, int64_t heads, int64_t kv_heads) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t tokens = qkv.size(0), dim = cos.size(1);
  TORCH_CHECK(dim % 2 == 0 && qkv.size(1) == (heads + 2 * kv_heads) * dim, "qkv width must be (H + 2 Hkv) * D");
  TORCH_CHECK(cos.size(0) == tokens && sin.sizes() == cos.sizes(), "cos and sin must be [T, D]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == tokens && slots.is_contiguous(), "slots: [T] int64");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 && k_cache.size(0) == kv_heads &&
                  k_cache.size(2) == dim && v_cache.sizes() == k_cache.sizes(),
              "caches must be contiguous [Hkv, slots, D]");
  for (const auto& t : {cos, sin, k_cache, v_cache})
    TORCH_CHECK(t.scalar_type() == qkv.scalar_type(), "every tensor must have qkv's dtype");
  at::Tensor q = at::empty({tokens, heads, dim}, qkv.options());
  float_or_bfloat16(qkv.scalar_type(), "rope_cache", [&](auto type) {
    rope_cache_impl<decltype(type)>(qkv, cos, sin, slots, k_cache, v_cache, q, heads, kv_heads);
  });
  return q;
}

template <typename T>
void paged_attention_impl(const at::Tensor& q, at::Tensor& out, const at::Tensor& tokens, const at::Tensor& rows,
                          const at::Tensor& context, const at::Tensor& tables, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, double scale) {
  const int64_t heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block = k_cache.size(2);
  const int64_t group = heads / kv_heads, n = tokens.numel(), table_width = tables.size(1);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* ctx = context.data_ptr<int64_t>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), kf(dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / kv_heads, kvh = item % kv_heads;
      const int64_t t = tok[i], length = ctx[i];
      const int64_t* table = tab + row[i] * table_width;
      scores.resize(group * length);
      for (int64_t g = 0; g < group; ++g) load_row(qp + (t * heads + kvh * group + g) * dim, qf.data() + g * dim, dim);
      // Scores: each key once, against the query heads that share its kv head.
      for (int64_t j = 0; j < length; ++j) {
        const T* k = kc + ((kvh * num_blocks + table[j / block]) * block + j % block) * dim;
        load_row(k, kf.data(), dim);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * dim;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += qg[d] * kf[d];
          scores[g * length + j] = dot * fscale;
        }
      }
      std::vector<float> total(group);
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * length;
        float top = sg[0];
        for (int64_t j = 1; j < length; ++j) top = sg[j] > top ? sg[j] : top;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < length; ++j) {
          sg[j] = exp_nonpositive(sg[j] - top);
          sum += sg[j];
        }
        total[g] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < length; ++j) {
        const T* v = vc + ((kvh * num_blocks + table[j / block]) * block + j % block) * dim;
        load_row(v, kf.data(), dim);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * length + j];
          float* ag = acc.data() + g * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) ag[d] += p * kf[d];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* o = op + (t * heads + kvh * group + g) * dim;
        const float inv = 1.0f / total[g];
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) o[d] = round_to<T>(acc[g * dim + d] * inv);
      }
    }
  });
}

// For each listed query token tokens[i] of q [T, H, D]: attention over keys 0 .. context[i]-1 of
// the sequence whose block table is tables[rows[i]], read in place from the layer's cache
// [Hkv, blocks, block_size, D]; the result goes to out[tokens[i]].
void paged_attention(at::Tensor q, at::Tensor out, at::Tensor tokens, at::Tensor rows, at::Tensor context,
                     at::Tensor tables, at::Tensor k_cache, at::Tensor v_cache, double scale) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && q.dim() == 3 && out.sizes() == q.sizes(),
              "q and out must be contiguous [T, H, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  v_cache.sizes() == k_cache.sizes() && k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(0) == 0,
              "caches must be contiguous [Hkv, blocks, block_size, D], H a multiple of Hkv");
  for (const auto& t : {tokens, rows, context})
    TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.numel() == tokens.numel(),
                "tokens, rows and context: [N] int64");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.dim() == 2, "tables: [R, B] int64");
  for (const auto& t : {out, k_cache, v_cache})
    TORCH_CHECK(t.scalar_type() == q.scalar_type(), "every tensor must have q's dtype");
  float_or_bfloat16(q.scalar_type(), "paged_attention", [&](auto type) {
    paged_attention_impl<decltype(type)>(q, out, tokens, rows, context, tables, k_cache, v_cache, scale);
  });
}

#if defined(__AVX512F__)
// Projections for the few rows of a decode step (1 to 64 tokens). A step streams every weight
// from memory once, and at these row counts oneDNN's kernels reach 13-17 GB/s in fp32: they read
// a stretch of weight, then compute on it, and do not overlap the two. Here the weight is packed
// once into panels of 32 output columns, each contiguous; a block of up to 12 rows keeps 12 x 2
// accumulators in registers over the whole K, and while the second block of rows computes on a
// panel (from L2 by then) the next panel is prefetched. Every output is one running fp32 sum over
// k in order: fused multiply-adds in fp32; in bf16 the CPU's bf16 dot product of k-pairs (exact
// products, fp32 sums), rounded to bf16 once at the end, after the bias.
//   fp32 panels: [ceil(N / 32), K, 32]        bf16 panels: [ceil(N / 32), ceil(K / 2), 32, 2]
constexpr int64_t kPanel = 32;
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

#if defined(__AVX512BF16__)
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

#if defined(__AVX512BF16__)
inline void store_panel_row(c10::BFloat16* out, __m512 lo, __m512 hi, int64_t left) {
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(lo)),
                                          (__m256i)_mm512_cvtneps_pbh(hi), 1);
  const __mmask32 lanes = left >= 32 ? ~__mmask32(0) : __mmask32((uint64_t{1} << left) - 1);
  _mm512_mask_storeu_epi16(out, lanes, both);
}
#endif

inline __m512 load_bias(const float* bias, int64_t left) { return _mm512_maskz_loadu_ps(first_lanes(left), bias); }

#if defined(__AVX512BF16__)
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
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
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

// The dtypes panel_linear computes on this CPU: fp32 with AVX-512, bf16 with AVX512-BF16 too.
bool panels_for(at::ScalarType dtype) {
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return true;
#endif
#if defined(__AVX512F__)
  if (dtype == at::kFloat) return true;
#endif
  return false;
}

// w [N, K] -> its panels (the layout above), the columns past N and a bf16 lone last k zero.
at::Tensor pack_panels(at::Tensor w) {
  check_rows(w, "w");
  TORCH_CHECK(panels_for(w.scalar_type()), "pack_panels: this CPU has no panel_linear for ", w.scalar_type());
  const int64_t n = w.size(0), k = w.size(1), panels = (n + 31) / 32, width = w.scalar_type() == at::kFloat ? 1 : 2;
  const int64_t steps = (k + width - 1) / width;
  at::Tensor packed = at::zeros(width == 1 ? std::vector<int64_t>{panels, k, 32} : std::vector<int64_t>{panels, steps, 32, 2},
                                w.options());
  const auto elem = w.element_size();
  const char* src = static_cast<const char*>(w.data_ptr());
  char* dst = static_cast<char*>(packed.data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < 32 && p * 32 + j < n; ++j)
        for (int64_t i = 0; i < k; ++i)
          std::memcpy(dst + (((p * steps + i / width) * 32 + j) * width + i % width) * elem,
                      src + ((p * 32 + j) * k + i) * elem, elem);
  });
  return packed;
}

// x [M, K] @ w.T (+ bias), w given as pack_panels(w) and its row count N; fp32 or bf16.
at::Tensor panel_linear(at::Tensor x, at::Tensor panels, int64_t n, c10::optional<at::Tensor> bias) {
  x = x.contiguous();
  check_rows(x, "x");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(panels_for(dtype) && panels.scalar_type() == dtype, "panel_linear: x and the panels in one dtype "
              "this CPU computes them in");
  const int64_t m = x.size(0), k = x.size(1), width = dtype == at::kFloat ? 1 : 2;
  TORCH_CHECK(panels.is_contiguous() && panels.dim() == (width == 1 ? 3 : 4) && panels.size(0) == (n + 31) / 32 &&
              panels.size(1) == (k + width - 1) / width && panels.size(2) == 32,
              "panel_linear: panels must be pack_panels(w) of w [n, K]");
  if (bias) TORCH_CHECK(bias->is_contiguous() && bias->numel() == n && bias->scalar_type() == dtype, "bad bias");
  at::Tensor out = at::empty({m, n}, x.options());
  const int64_t panel_elems = panels.numel() / panels.size(0);
#if defined(__AVX512F__)
  if (dtype == at::kFloat)
    panel_linear_impl<float>(x.data_ptr<float>(), panels.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr,
                             out.data_ptr<float>(), m, k, n, panels.size(0), panel_elems);
#endif
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16)
    panel_linear_impl<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), panels.data_ptr<c10::BFloat16>(),
                                     bias ? bias->data_ptr<c10::BFloat16>() : nullptr, out.data_ptr<c10::BFloat16>(),
                                     m, k, n, panels.size(0), panel_elems);
#endif
  return out;
}

// oneDNN's matmul over a prepacked weight, the op worker/fused_layers.py's Weight calls.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias, std::string("none"), c10::List<c10::optional<at::Scalar>>(), std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// One projection, chosen as Weight.__call__ chooses: the panels where there are some, else the
// prepacked weight where there is one, else the plain matmul (F.linear's op).
struct Projection {
  at::Tensor w;
  c10::optional<at::Tensor> packed, panels, bias;

  at::Tensor operator()(const at::Tensor& x) const {
    if (panels) return panel_linear(x, *panels, w.size(0), bias);
    return packed ? packed_linear(x, *packed, bias) : at::linear(x, w, bias);
  }
};

// A llama-family model's layers for a step of one token (one stream decoding): the same kernels
// and matmuls as the per-layer calls from Python, in one call, so the step pays no per-op Python
// overhead. Each projection is given as (weight, prepacked weight or None, panels or None, bias
// or None).
using ProjectionArgs =
    std::tuple<at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>, c10::optional<at::Tensor>>;

struct Layers {
  std::vector<at::Tensor> ln1, ln2;
  std::vector<Projection> qkv, o, gate_up, down;
  int64_t heads, kv_heads;
  double eps, scale;

  static std::vector<Projection> projections(const std::vector<ProjectionArgs>& args) {
    std::vector<Projection> out;
    for (const auto& [w, packed, panels, bias] : args) out.push_back(Projection{w, packed, panels, bias});
    return out;
  }

  Layers(std::vector<at::Tensor> ln1, std::vector<at::Tensor> ln2, const std::vector<ProjectionArgs>& qkv,
         const std::vector<ProjectionArgs>& o, const std::vector<ProjectionArgs>& gate_up,
         const std::vector<ProjectionArgs>& down, int64_t heads, int64_t kv_heads, double eps, double scale)
      : ln1(std::move(ln1)), ln2(std::move(ln2)), qkv(projections(qkv)), o(projections(o)),
        gate_up(projections(gate_up)), down(projections(down)), heads(heads), kv_heads(kv_heads), eps(eps),
        scale(scale) {}

  // h [T, hidden] (updated in place); returns h after the last layer's residual.
  at::Tensor run(at::Tensor h, at::Tensor cos, at::Tensor sin, at::Tensor slots, at::Tensor k_cache, at::Tensor v_cache,
                 at::Tensor tokens, at::Tensor rows, at::Tensor context, at::Tensor tables) {
    const int64_t total = h.size(0), dim = cos.size(1);
    c10::optional<at::Tensor> y;
    for (size_t i = 0; i < qkv.size(); ++i) {
      at::Tensor kc = k_cache.select(0, i), vc = v_cache.select(0, i);
      at::Tensor x = add_rms_norm(h, y, ln1[i], eps);
      at::Tensor q = rope_cache(qkv[i](x), cos, sin, slots, kc.view({kv_heads, -1, dim}), vc.view({kv_heads, -1, dim}),
                                heads, kv_heads);
      at::Tensor attended = at::empty_like(q);
      paged_attention(q, attended, tokens, rows, context, tables, kc, vc, scale);
      x = add_rms_norm(h, o[i](attended.view({total, -1})), ln2[i], eps);
      at::Tensor gu = gate_up[i](x);
      const int64_t inter = gu.size(1) / 2;
      y = down[i](at::mul(at::silu(gu.narrow(1, 0, inter)), gu.narrow(1, inter, inter)));
    }
    return y ? h.add_(*y) : h;
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "out = rms_norm(h + y), h updated to h + y");
  m.def("rope_cache", &rope_cache, "rotary on q and k; k and v written to the cache");
  m.def("paged_attention", &paged_attention, "attention over the paged cache, read in place");
  m.def("pack_panels", &pack_panels, "a weight [N, K] in 32-column panels, for panel_linear");
  m.def("panel_linear", &panel_linear, "x @ w.T (+ bias), w as pack_panels(w) and its row count (panel_dtypes)");
  pybind11::class_<Layers>(m, "Layers")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<at::Tensor>, const std::vector<ProjectionArgs>&,
                          const std::vector<ProjectionArgs>&, const std::vector<ProjectionArgs>&,
                          const std::vector<ProjectionArgs>&, int64_t, int64_t, double, double>())
      .def("run", &Layers::run, "the layers of a one-token step");
  m.attr("panel_dtypes") = std::vector<std::string>{
#if defined(__AVX512F__)
      "float32",
#endif
#if defined(__AVX512BF16__)
      "bfloat16",
#endif
  };
}
