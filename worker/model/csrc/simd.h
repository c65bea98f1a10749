// The few vector operations the projection kernels are written in, for AVX2 (8 floats) and
// AVX-512 (16 floats): one kernel template serves both ISAs, and since each lane runs the same
// sequence of roundings (fused multiply-adds over k in order), both give the same bits.
//
// Codes of a quantized panel row (32 output columns at one k): 8-bit, one signed byte a column;
// 4-bit, 16 bytes where byte j holds column j in its low nibble and column j + 16 in its high
// one, so either half of the row is one mask (and one shift) away.
#pragma once

#include <algorithm>
#include <cstdint>

#include "isa.h"

namespace streamq {

constexpr int64_t kPanel = 32;  // output columns of a panel

// Panels per parallel task: a task of fewer than ~2^18 multiply-adds runs faster on the calling
// thread than handed to another (a small projection otherwise waits on a thread's wake-up, ms on
// a loaded machine); a decode step's projection of a real model still spreads over every thread.
inline int64_t panel_grain(int64_t rows, int64_t k) {
  return std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, rows * k * kPanel));
}

#if defined(STREAMQ_AVX2)
struct Avx2 {
  using F = __m256;
  static constexpr int kWidth = 8;
  static F zero() { return _mm256_setzero_ps(); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F broadcast(float v) { return _mm256_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a * b, rounded once
  static F add(F a, F b) { return _mm256_add_ps(a, b); }

  // Columns 8v .. 8v + 7 of a panel row of codes, as floats.
  template <int Bits> static F codes(const uint8_t* row, int v) {
    if constexpr (Bits == 8) {
      return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * v))));
    } else {
      __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * (v & 1)));
      if (v >= 2) b = _mm_srli_epi16(b, 4);
      b = _mm_and_si128(b, _mm_set1_epi8(0x0F));
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
    }
  }
};
#endif

#if defined(STREAMQ_AVX512)
struct Avx512 {
  using F = __m512;
  static constexpr int kWidth = 16;
  static F zero() { return _mm512_setzero_ps(); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F broadcast(float v) { return _mm512_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }

  // Columns 16v .. 16v + 15 of a panel row of codes, as floats.
  template <int Bits> static F codes(const uint8_t* row, int v) {
    if constexpr (Bits == 8) {
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * v))));
    } else {
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
      if (v == 1) b = _mm_srli_epi16(b, 4);
      b = _mm_and_si128(b, _mm_set1_epi8(0x0F));
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
    }
  }
};
#endif

// Stores the `left` first of a block's 32 columns, plus the bias where there is one: full vectors
// straight to `out`, a partial last panel through a buffer.
template <class S>
inline void store_columns(float* out, const typename S::F* lanes, int v0, int vectors, const float* bias,
                          int64_t left) {
  for (int v = 0; v < vectors; ++v) {
    const int64_t c = (v0 + v) * S::kWidth;
    if (c >= left) return;
    typename S::F value = lanes[v];
    if (c + S::kWidth <= left) {
      if (bias) value = S::add(value, S::load(bias + c));
      S::store(out + c, value);
    } else {
      alignas(64) float buffer[S::kWidth];
      S::store(buffer, value);
      for (int64_t j = 0; c + j < left; ++j) out[c + j] = bias ? buffer[j] + bias[c + j] : buffer[j];
    }
  }
}

}  // namespace streamq
