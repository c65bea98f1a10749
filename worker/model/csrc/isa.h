// Which instruction set a projection kernel runs on, chosen per call.
//
// The kernels are compiled with -march=native, so a build holds the AVX-512 paths only on an
// AVX-512 CPU; there it also holds the 8-wide AVX2 paths (AVX-512 implies AVX2 and FMA), and a
// caller may pick either: the tests run both on one machine. "auto" is the widest.
//
// "avx512vnni" is AVX-512 with its integer dot product (VPDPBUSD): quantized weights then run on
// quant_linear_int8, which rounds each row's activations to int8 per group (as llama.cpp's
// kernels do) and sums code x activation products in int32; float weights run as on "avx512".
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace streamq {

enum class Isa { kAvx2, kAvx512, kAvx512Vnni };

// The AVX-512 paths use the byte and 256-bit forms of its masked loads and stores (BW, VL).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define STREAMQ_AVX512 1
inline constexpr bool kHasAvx512 = true;
#else
inline constexpr bool kHasAvx512 = false;
#endif
#if defined(STREAMQ_AVX512) && defined(__AVX512VNNI__)
#define STREAMQ_VNNI 1
inline constexpr bool kHasVnni = true;
#else
inline constexpr bool kHasVnni = false;
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define STREAMQ_AVX2 1
inline constexpr bool kHasAvx2 = true;
#else
inline constexpr bool kHasAvx2 = false;
#endif

// The ISAs this build holds and this CPU runs, widest first. The CPU check guards against a
// build copied to another machine (the cache is keyed by the CPU's flags, so it should not be).
inline const std::vector<std::string>& runnable_isas() {
  static const std::vector<std::string> isas = [] {
    std::vector<std::string> out;
    const bool avx512 = kHasAvx512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl");
    if (avx512 && kHasVnni && __builtin_cpu_supports("avx512vnni")) out.push_back("avx512vnni");
    if (kHasAvx512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
      out.push_back("avx512");
    if (kHasAvx2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) out.push_back("avx2");
    return out;
  }();
  return isas;
}

inline std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& name : names) out += (out.empty() ? "" : ", ") + name;
  return out.empty() ? "none" : out;
}

// "auto", "avx512vnni", "avx512" or "avx2" -> the ISA to run; an error names the one asked for and those there are.
inline Isa choose_isa(const std::string& name) {
  const auto& isas = runnable_isas();
  const std::string pick = name == "auto" && !isas.empty() ? isas.front() : name;
  for (const auto& have : isas)
    if (have == pick) return pick == "avx512vnni" ? Isa::kAvx512Vnni : pick == "avx512" ? Isa::kAvx512 : Isa::kAvx2;
  TORCH_CHECK(false, "isa '", name, "' asked for, but this CPU and build run the projection kernels only on: ",
              joined(isas), " (and the portable path, which is Python's)");
}

// The ISA the fp32-activation kernels (panel_linear, quant_linear) run for `isa`: VNNI's is AVX-512's.
inline Isa float_isa(Isa isa) { return isa == Isa::kAvx512Vnni ? Isa::kAvx512 : isa; }

}  // namespace streamq
