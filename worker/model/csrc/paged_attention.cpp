// Attention over the paged KV cache, read in place through each sequence's block table: decodes,
// speculative verifies and prefill chunks of any length alike.
//
// Each (query token, head) is one fixed sequence of roundings that depends on its own sequence
// only, so a token gets the same bits decoded alone, in any batch, in a prefill chunk of any
// length, after a prefix-cache hit, or replayed by another worker after a failover:
//   scores   a key's score is an fp32 dot product: lane l sums q[d] k[d] over d = l, l + 16, ...
//            in order, one fused multiply-add a term, then the 16 lanes add in a fixed tree;
//            times the scale. Keys are taken 16 positions at a time (16c .. 16c + 15, lane p % 16)
//   softmax  the max, then e^(s - max); their sum adds each lane over c in order, then the 16
//            lanes in the same tree
//   output   the sum of p_j v_j over the keys in order, one fused multiply-add a term, over the sum
// Up to kTileRows query tokens of one sequence share each key's load (a prefill chunk's tokens):
// that changes the speed, not the sums. Keys outside a token's own range (past its context, or
// before the sliding window that ends at its position) are skipped or count as exact zeros.
//
// Three forms of the same sums, chosen per call (`isa`): plain loops over 16 lanes ("portable",
// vectorised by the compiler as it can), and AVX2 and AVX-512 intrinsics for the scores' dot
// products and lane tree, the softmax and the output's sums. Each lane runs the same operations in the
// same order in all three, so every ISA gives the same bits (tested): a request replayed on
// another machine continues with the same numbers.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace streamq {
namespace {

constexpr int64_t kLanes = 16;    // keys scored at once; head-dimension columns summed at once
constexpr int64_t kTileRows = 16;  // query tokens of one sequence that share each key's load

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }
template <typename T> inline T narrow(float x) { return static_cast<T>(x); }

// 16 floats, one lane each: GCC's vector extension, lowered to whatever vectors the CPU has.
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));

// e^x in each lane for x <= 0 (softmax after the max is taken off): Cody-Waite range reduction
// and a degree-6 polynomial, within 2 ulp of expf; below e^-87 it gives ~1e-38, not 0.
inline Lanes exp_nonpositive(Lanes x) {
  x = x < -87.0f ? (Lanes){} - 87.0f : x;
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const Lanes n = (x * 1.44269504088896341f + shifter) - shifter;
  Lanes r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  Lanes p = (Lanes){} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const Lanes y = p * (r * r) + r + 1.0f;
  const Ints bits = (__builtin_convertvector(n, Ints) + 127) << 23;
  return y * (Lanes)bits;
}

const Ints kIota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

inline Lanes load_lanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// a * b + c in each lane, rounded once (the CPU's fused multiply-add where it has one).
inline Lanes fma_lanes(float a, Lanes b, Lanes c) {
  Lanes out;
  for (int64_t l = 0; l < kLanes; ++l) out[l] = __builtin_fmaf(a, b[l], c[l]);
  return out;
}

// The 16 lanes' sum, always in the same tree.
inline float lane_sum(float* v) {
  for (int64_t width = kLanes / 2; width >= 1; width /= 2)
    for (int64_t l = 0; l < width; ++l) v[l] += v[l + width];
  return v[0];
}

// Where a tile's keys are, and which of them each query vector sees.
template <typename T>
struct Tile {
  const int64_t* table;
  int64_t dim, block, head_base;  // head_base: (kv head * blocks) of the caches' layout
  int64_t lo, hi;                 // the tile's keys: lo .. hi - 1 (the union of its tokens' ranges)
  const int64_t* first;           // per query vector: its first key and one past its last
  const int64_t* end;

  const T* row_of(const T* cache, int64_t p) const {
    return cache + ((head_base + table[p / block]) * block + p % block) * dim;
  }
  Ints seen(int64_t v, Ints p) const {  // whether vector v sees key p, in each lane: -1 (yes) or 0
    return (p >= static_cast<int32_t>(first[v])) & (p < static_cast<int32_t>(end[v]));
  }
  // Rows p0 .. p0 + count - 1 of a cache as floats, `width` apart, zero past hi and past dim.
  void widen_rows(const T* cache, int64_t p0, int64_t count, int64_t width, float* out) const {
    for (int64_t i = 0; i < count; ++i) {
      float* dst = out + i * width;
      std::fill(dst, dst + width, 0.0f);
      if (p0 + i >= hi) continue;
      const T* src = row_of(cache, p0 + i);
      for (int64_t d = 0; d < dim; ++d) dst[d] = widen(src[d]);
    }
  }
};

// Lanes of a and b by index (0..15 a's, 16..31 b's).
#define PICK(a, b, ...) __builtin_shuffle(a, b, (Ints){__VA_ARGS__})

// The sums of 16 vectors' lanes, vector j's in lane j, in lane_sum's tree: each level adds the
// upper half of every vector's remaining lanes to the lower half, two vectors packed into one.
inline Lanes sums_of(Lanes* x) {
  Lanes y[8], z[4], w[2];
  for (int i = 0; i < 8; ++i)
    y[i] = PICK(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           PICK(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    z[i] = PICK(y[2 * i], y[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           PICK(y[2 * i], y[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    w[i] = PICK(z[2 * i], z[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           PICK(z[2 * i], z[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return PICK(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         PICK(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
#undef PICK

// a * b + c in each lane, rounded once.
inline Lanes fma_each(Lanes a, Lanes b, Lanes c) {
  Lanes out;
  for (int64_t l = 0; l < kLanes; ++l) out[l] = __builtin_fmaf(a[l], b[l], c[l]);
  return out;
}

// The scores of one query vector q (width floats, zero past dim) against 16 keys k (rows of width
// floats): for key j, lane l sums q[d] k_j[d] over d = l, l + 16, ... in order, one fused
// multiply-add a term; then the lanes in sums_of's tree; then times the scale.
inline void score_keys(const float* q, const float* k, int64_t width, float scale, float* s) {
  Lanes acc[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) {
    Lanes sum = {};
    for (int64_t d = 0; d < width; d += kLanes) sum = fma_each(load_lanes(q + d), load_lanes(k + j * width + d), sum);
    acc[j] = sum;
  }
  const Lanes out = sums_of(acc) * scale;
  std::memcpy(s, &out, sizeof(out));
}

// A query vector's scores s (chunks of 16 keys from key `from`, -inf where unseen) -> e^(s - max)
// where it sees the key (first .. end - 1), exact zeros elsewhere; returns their sum: lane by lane
// over the chunks in order, then the lanes in lane_sum's tree.
inline float softmax_lanes(float* s, int64_t chunks, int64_t from, int64_t first, int64_t end) {
  const float unseen = -std::numeric_limits<float>::infinity();
  Lanes most = (Lanes){} + unseen;
  for (int64_t c = 0; c < chunks; ++c) {
    const Lanes sc = load_lanes(s + c * kLanes);
    most = sc > most ? sc : most;
  }
  float top = unseen;
  for (int64_t l = 0; l < kLanes; ++l) top = most[l] > top ? most[l] : top;
  Lanes sums = {};
  for (int64_t c = 0; c < chunks; ++c) {
    const Ints position = static_cast<int32_t>(from + c * kLanes) + kIota;
    const Ints seen = (position >= static_cast<int32_t>(first)) & (position < static_cast<int32_t>(end));
    const Lanes e = seen ? exp_nonpositive(load_lanes(s + c * kLanes) - top) : (Lanes){};
    std::memcpy(s + c * kLanes, &e, sizeof(e));
    sums += e;
  }
  float lanes[kLanes];
  std::memcpy(lanes, &sums, sizeof(sums));
  return lane_sum(lanes);
}

// The portable form: the lanes as GCC's vector extension.
struct Portable {
  static constexpr int kGroup = 8;  // query vectors whose output sums run together
  static constexpr int kParts = 1;  // vectors of 16 lanes
  using Part = Lanes;
  static Part zero() { return Part{}; }
  static Part load(const float* p) { return load_lanes(p); }
  static Part fma(float a, Part b, Part c) { return fma_lanes(a, b, c); }
  static void store(float* p, Part v) { std::memcpy(p, &v, sizeof(v)); }
  static void score(const float* q, const float* k, int64_t width, float scale, float* s) {
    score_keys(q, k, width, scale, s);
  }
  static float softmax(float* s, int64_t chunks, int64_t from, int64_t first, int64_t end) {
    return softmax_lanes(s, chunks, from, first, end);
  }
};

#if defined(STREAMQ_AVX2)
// lane_sum's tree past its first level, for 8 keys at once: y[j] holds key j's first-level sums
// (lane l: its lanes l + l + 8); the result, key j's whole sum in lane j. Each level adds the same
// pairs as lane_sum: lanes l and l + 4, then l and l + 2, then 0 and 1.
inline __m256 tree8(const __m256* y) {
  __m256 z[4], w[2];
  for (int i = 0; i < 4; ++i)  // [a_l + a_l+4 | b_l + b_l+4], keys a = 2i, b = 2i + 1
    z[i] = _mm256_add_ps(_mm256_permute2f128_ps(y[2 * i], y[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(y[2 * i], y[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i) {  // [a_l + a_l+2, c_l + c_l+2 | b.., d..], keys a..d = 4i .. 4i + 3
    const __m256d a = _mm256_castps_pd(z[2 * i]), b = _mm256_castps_pd(z[2 * i + 1]);
    w[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  // lanes 0 + 1: keys in the order 0 2 4 6 1 3 5 7, then put in order
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(w[0], w[1], 0x88), _mm256_shuffle_ps(w[0], w[1], 0xDD));
  return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// score_keys with the tree above: each key's lane sums (P::halves4: their first level), 8 keys a tree.
template <typename P>
void score_by_tree(const float* q, const float* k, int64_t width, float scale, float* s) {
  const __m256 times = _mm256_set1_ps(scale);
  for (int half = 0; half < 2; ++half) {
    __m256 y[8];
    for (int j = 0; j < 8; j += 4) P::halves4(q, k + (half * 8 + j) * width, width, y + j);
    _mm256_storeu_ps(s + half * 8, _mm256_mul_ps(tree8(y), times));
  }
}

// exp_nonpositive on 8 lanes, the same operations in the same order.
inline __m256 exp_nonpositive8(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.0f), shifter = _mm256_set1_ps(12582912.0f);
  x = _mm256_blendv_ps(x, low, _mm256_cmp_ps(x, low, _CMP_LT_OQ));
  const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), shifter), shifter);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_add_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
  const __m256 y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// softmax_lanes on two 8-lane halves: the same sums (a max is exact in any order).
inline float softmax_avx2(float* s, int64_t chunks, int64_t from, int64_t first, int64_t end) {
  __m256 most = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < 2 * chunks; ++i) most = _mm256_max_ps(most, _mm256_loadu_ps(s + 8 * i));
  float lanes[kLanes];
  _mm256_storeu_ps(lanes, most);
  float top = lanes[0];
  for (int l = 1; l < 8; ++l) top = lanes[l] > top ? lanes[l] : top;
  const __m256 max = _mm256_set1_ps(top);
  const __m256i after = _mm256_set1_epi32(static_cast<int32_t>(first) - 1), before = _mm256_set1_epi32(static_cast<int32_t>(end));
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 sums[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t i = 0; i < 2 * chunks; ++i) {  // lanes 0-7, then 8-15, of each chunk
    const __m256i position = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(from + 8 * i)), iota);
    const __m256i seen = _mm256_and_si256(_mm256_cmpgt_epi32(position, after), _mm256_cmpgt_epi32(before, position));
    const __m256 e = _mm256_and_ps(exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + 8 * i), max)),
                                   _mm256_castsi256_ps(seen));
    _mm256_storeu_ps(s + 8 * i, e);
    sums[i % 2] = _mm256_add_ps(sums[i % 2], e);
  }
  _mm256_storeu_ps(lanes, sums[0]);
  _mm256_storeu_ps(lanes + 8, sums[1]);
  return lane_sum(lanes);
}

// 16 lanes in the vectors of simd.h's S (kParts of them): the output sums' operations.
template <class S>
struct LanesOf {
  static constexpr int kParts = kLanes / S::kWidth;
  using Part = typename S::F;
  static Part zero() { return S::zero(); }
  static Part load(const float* p) { return S::load(p); }
  static Part fma(float a, Part b, Part c) { return S::fma(S::broadcast(a), b, c); }
  static void store(float* p, Part v) { S::store(p, v); }
};

// 16 lanes as two AVX2 vectors.
struct Avx2Lanes : LanesOf<Avx2> {
  static constexpr int kGroup = 6;  // 12 accumulators of the 16 registers
  // Four keys (rows of k, `width` apart): q . key's 16 lane sums (lane l over d = l, l + 16, ...),
  // then lanes l + l + 8, into y[0..3]. Four keys share each load of q.
  static void halves4(const float* q, const float* k, int64_t width, __m256* y) {
    __m256 lo[4], hi[4];
    for (int j = 0; j < 4; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < width; d += kLanes) {
      const __m256 qlo = _mm256_loadu_ps(q + d), qhi = _mm256_loadu_ps(q + d + 8);
      for (int j = 0; j < 4; ++j) {
        lo[j] = _mm256_fmadd_ps(qlo, _mm256_loadu_ps(k + j * width + d), lo[j]);
        hi[j] = _mm256_fmadd_ps(qhi, _mm256_loadu_ps(k + j * width + d + 8), hi[j]);
      }
    }
    for (int j = 0; j < 4; ++j) y[j] = _mm256_add_ps(lo[j], hi[j]);
  }
  static void score(const float* q, const float* k, int64_t width, float scale, float* s) {
    score_by_tree<Avx2Lanes>(q, k, width, scale, s);
  }
  static float softmax(float* s, int64_t chunks, int64_t from, int64_t first, int64_t end) {
    return softmax_avx2(s, chunks, from, first, end);
  }
};
#endif

#if defined(STREAMQ_AVX512)
// 16 lanes as one AVX-512 vector.
struct Avx512Lanes : LanesOf<Avx512> {
  static constexpr int kGroup = 12;
  static void halves4(const float* q, const float* k, int64_t width, __m256* y) {
    __m512 acc[4];
    for (int j = 0; j < 4; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < width; d += kLanes) {
      const __m512 qd = _mm512_loadu_ps(q + d);
      for (int j = 0; j < 4; ++j) acc[j] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(k + j * width + d), acc[j]);
    }
    for (int j = 0; j < 4; ++j)
      y[j] = _mm256_add_ps(_mm512_castps512_ps256(acc[j]),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[j]), 1)));
  }
  static void score(const float* q, const float* k, int64_t width, float scale, float* s) {
    score_by_tree<Avx512Lanes>(q, k, width, scale, s);
  }
  static float softmax(float* s, int64_t chunks, int64_t from, int64_t first, int64_t end) {
    return softmax_avx2(s, chunks, from, first, end);
  }
};
#endif

// Columns d0 .. d0 + 15 of NV query vectors' outputs: the sum over keys lo .. hi - 1 in order of
// p[v][j] * v_j (values: rows of width floats from key lo), each vector over its own keys
// first[v] .. end[v] - 1 only, one fused multiply-add a term; then times its 1 / (sum of p).
template <typename P, int NV, typename T>
void weigh_values(int64_t lo, int64_t hi, const int64_t* first, const int64_t* end, const float* const* p,
                  const float* inv, const float* values, int64_t width, int64_t d0, int64_t columns, T* const* out) {
  using Part = typename P::Part;
  constexpr int kParts = P::kParts;  // vectors a row of 16 columns takes
  Part acc[NV][kParts];
  const float* weight[NV];  // p[v], indexed by key
  int64_t f[NV], e[NV];
  for (int v = 0; v < NV; ++v) {
    f[v] = first[v], e[v] = end[v], weight[v] = p[v] - lo;
    for (int i = 0; i < kParts; ++i) acc[v][i] = P::zero();
  }
  // Keys every vector sees need no check: from the last first to the first end.
  const int64_t all_from = *std::max_element(f, f + NV), all_to = *std::min_element(e, e + NV);
  // Keys only some vectors see, one at a time (few: a chunk's last tokens' own keys), then the
  // keys all see in a loop with nothing to check, its accumulators in registers.
  auto checked = [&](int64_t j) {
    const float* row = values + (j - lo) * width + d0;
    for (int v = 0; v < NV; ++v)
      if (j >= f[v] && j < e[v])
        for (int i = 0; i < kParts; ++i) acc[v][i] = P::fma(weight[v][j], P::load(row + i * (kLanes / kParts)), acc[v][i]);
  };
  const int64_t from = std::min(std::max(all_from, lo), hi), to = std::max(std::min(all_to, hi), from);
  for (int64_t j = lo; j < from; ++j) checked(j);
  {
    Part a[NV][kParts];
    for (int v = 0; v < NV; ++v)
      for (int i = 0; i < kParts; ++i) a[v][i] = acc[v][i];
    const float* row = values + (from - lo) * width + d0;
    for (int64_t j = from; j < to; ++j, row += width) {
      Part r[kParts];
      for (int i = 0; i < kParts; ++i) r[i] = P::load(row + i * (kLanes / kParts));
      for (int v = 0; v < NV; ++v)
        for (int i = 0; i < kParts; ++i) a[v][i] = P::fma(weight[v][j], r[i], a[v][i]);
    }
    for (int v = 0; v < NV; ++v)
      for (int i = 0; i < kParts; ++i) acc[v][i] = a[v][i];
  }
  for (int64_t j = to; j < hi; ++j) checked(j);
  for (int v = 0; v < NV; ++v) {
    float sums[kLanes];
    for (int i = 0; i < kParts; ++i) P::store(sums + i * (kLanes / kParts), acc[v][i]);
    for (int64_t l = 0; l < columns; ++l) out[v][d0 + l] = narrow<T>(sums[l] * inv[v]);
  }
}

template <typename P, typename T, int NV = P::kGroup>
void weigh_dispatch(int nv, int64_t lo, int64_t hi, const int64_t* first, const int64_t* end, const float* const* p,
                    const float* inv, const float* values, int64_t width, int64_t d0, int64_t columns, T* const* out) {
  if constexpr (NV > 1) {
    if (nv < NV) return weigh_dispatch<P, T, NV - 1>(nv, lo, hi, first, end, p, inv, values, width, d0, columns, out);
  }
  weigh_values<P, NV, T>(lo, hi, first, end, p, inv, values, width, d0, columns, out);
}

template <typename P, typename T>
void paged_attention_impl(const at::Tensor& q, at::Tensor& out, const at::Tensor& tokens, const at::Tensor& rows,
                          const at::Tensor& context, const at::Tensor& tables, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, double scale, int64_t window, const int64_t* pos) {
  const int64_t heads = q.size(1), dim = q.size(2), width = (dim + kLanes - 1) / kLanes * kLanes;
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block = k_cache.size(2);
  const int64_t group = heads / kv_heads, n = tokens.numel(), table_width = tables.size(1);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* kc = k_cache.data_ptr<T>();
  const T* vc = v_cache.data_ptr<T>();
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* ctx = context.data_ptr<int64_t>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  // Each token's first key: 0, or the start of its sliding window (which ends at its position:
  // its last key, unless it sees past itself).
  std::vector<int64_t> firsts(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t last = pos != nullptr ? pos[i] + 1 : ctx[i];
    firsts[i] = window > 0 && last > window ? last - window : 0;
  }
  // Tiles: runs of up to kTileRows listed tokens of one sequence (a chunk's tokens are listed together).
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < n; ++i)
    if (starts.empty() || row[i] != row[starts.back()] || i - starts.back() == kTileRows) starts.push_back(i);
  starts.push_back(n);
  const int64_t tiles = static_cast<int64_t>(starts.size()) - 1;
  // A long chunk's later tiles have more keys: taking tiles from both ends in turn gives each
  // thread's contiguous share of the items about equal work.
  auto zigzag = [tiles](int64_t k) { return k % 2 == 0 ? k / 2 : tiles - 1 - k / 2; };
  at::parallel_for(0, tiles * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, scores, keys, values, inv;
    std::vector<int64_t> vfirst, vend;
    std::vector<const float*> pv;
    std::vector<T*> ov;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t tile_index = zigzag(item / kv_heads), kvh = item % kv_heads;
      const int64_t t0 = starts[tile_index], count = starts[tile_index + 1] - t0, nv = count * group;
      vfirst.resize(nv);
      vend.resize(nv);
      for (int64_t v = 0; v < nv; ++v) vfirst[v] = firsts[t0 + v / group], vend[v] = ctx[t0 + v / group];
      const Tile<T> tile{tab + row[t0] * table_width, dim, block, kvh * num_blocks,
                         *std::min_element(vfirst.begin(), vfirst.end()), *std::max_element(vend.begin(), vend.end()),
                         vfirst.data(), vend.data()};
      const int64_t c0 = tile.lo / kLanes, chunks = (tile.hi - 1) / kLanes - c0 + 1, span = chunks * kLanes;
      qf.assign(nv * width, 0.0f);
      scores.resize(nv * span);
      inv.resize(nv);
      keys.resize(span * width);
      values.resize((tile.hi - tile.lo) * width);
      tile.widen_rows(kc, c0 * kLanes, span, width, keys.data());
      tile.widen_rows(vc, tile.lo, tile.hi - tile.lo, width, values.data());
      for (int64_t v = 0; v < nv; ++v) {
        const T* src = qp + (tok[t0 + v / group] * heads + kvh * group + v % group) * dim;
        for (int64_t d = 0; d < dim; ++d) qf[v * width + d] = widen(src[d]);
      }
      // Scores, 16 keys at a time; keys a vector does not see become -inf.
      const float unseen = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < chunks; ++c) {
        const Ints position = static_cast<int32_t>((c0 + c) * kLanes) + kIota;
        for (int64_t v = 0; v < nv; ++v) {
          float* s = scores.data() + v * span + c * kLanes;
          P::score(qf.data() + v * width, keys.data() + c * kLanes * width, width, fscale, s);
          const Lanes masked = tile.seen(v, position) ? load_lanes(s) : (Lanes){} + unseen;
          std::memcpy(s, &masked, sizeof(masked));
        }
      }
      // Softmax: e^(s - max), zero where unseen; the sum lane by lane over the chunks, then the lanes.
      for (int64_t v = 0; v < nv; ++v)
        inv[v] = 1.0f / P::softmax(scores.data() + v * span, chunks, c0 * kLanes, vfirst[v], vend[v]);
      // Output, 16 columns at a time; p indexed from key lo.
      pv.resize(nv);
      ov.resize(nv);
      for (int64_t v = 0; v < nv; ++v) {
        pv[v] = scores.data() + v * span + (tile.lo - c0 * kLanes);
        ov[v] = op + (tok[t0 + v / group] * heads + kvh * group + v % group) * dim;
      }
      for (int64_t v = 0; v < nv; v += P::kGroup)
        for (int64_t d0 = 0; d0 < dim; d0 += kLanes)
          weigh_dispatch<P, T>(static_cast<int>(std::min<int64_t>(P::kGroup, nv - v)), tile.lo, tile.hi, vfirst.data() + v,
                            vend.data() + v, pv.data() + v, inv.data() + v, values.data(), width, d0,
                            std::min<int64_t>(kLanes, dim - d0), ov.data() + v);
    }
  });
}

}  // namespace

void paged_attention(at::Tensor q, at::Tensor out, at::Tensor tokens, at::Tensor rows, at::Tensor context,
                     at::Tensor tables, at::Tensor k_cache, at::Tensor v_cache, double scale, int64_t window,
                     const c10::optional<at::Tensor>& positions, const std::string& isa) {
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
  const int64_t* ctx = context.data_ptr<int64_t>();
  for (int64_t i = 0; i < context.numel(); ++i) TORCH_CHECK(ctx[i] >= 1, "every token sees at least its own key");
  const int64_t* pos = nullptr;
  if (positions.has_value()) {
    TORCH_CHECK(positions->scalar_type() == at::kLong && positions->is_contiguous() &&
                    positions->numel() == tokens.numel(), "positions: [N] int64");
    pos = positions->data_ptr<int64_t>();
    for (int64_t i = 0; i < tokens.numel(); ++i)
      TORCH_CHECK(0 <= pos[i] && pos[i] < ctx[i], "a token sees its own position's key");
  }
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "paged_attention: float32 or bfloat16 only");
  const bool portable = isa == "portable" || (isa == "auto" && runnable_isas().empty());
  const Isa chosen = portable ? Isa::kAvx2 : float_isa(choose_isa(isa));
  auto run = [&](auto policy) {
    using P = decltype(policy);
    if (q.scalar_type() == at::kFloat)
      paged_attention_impl<P, float>(q, out, tokens, rows, context, tables, k_cache, v_cache, scale, window, pos);
    else
      paged_attention_impl<P, c10::BFloat16>(q, out, tokens, rows, context, tables, k_cache, v_cache, scale, window, pos);
  };
#if defined(STREAMQ_AVX512)
  if (!portable && chosen == Isa::kAvx512) return run(Avx512Lanes{});
#endif
#if defined(STREAMQ_AVX2)
  if (!portable && chosen == Isa::kAvx2) return run(Avx2Lanes{});
#endif
  run(Portable{});
}

}  // namespace streamq
