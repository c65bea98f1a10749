// What the step kernels' sources share: the projection kernels step_kernels.cpp binds and calls.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

#include "isa.h"

namespace streamq {

inline void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.dim() == 2, name, " must be a contiguous 2-d CPU tensor");
}

// panel_linear.cpp: float weights in panels of 32 columns.
bool panels_for(at::ScalarType dtype, Isa isa);
std::vector<std::string> panel_dtypes(const std::string& isa);
at::Tensor pack_panels(at::Tensor w);
at::Tensor panel_linear(at::Tensor x, at::Tensor panels, int64_t n, c10::optional<at::Tensor> bias,
                        const std::string& isa);

// quant_linear.cpp: weights of 4- or 8-bit codes with group-wise scales (worker/quantized.py).
at::Tensor pack_quantized(at::Tensor q, at::Tensor scale, c10::optional<at::Tensor> offset, int64_t bits);
at::Tensor quant_linear(at::Tensor x, at::Tensor packed, int64_t n, int64_t group, int64_t bits,
                        c10::optional<at::Tensor> bias, const std::string& isa);

// quant_linear_int8.cpp: the same weights in VNNI's layout, x rounded to int8 ("avx512vnni").
at::Tensor pack_quantized_int8(at::Tensor q, at::Tensor scale, c10::optional<at::Tensor> offset, int64_t bits);
at::Tensor quant_linear_int8(at::Tensor x, at::Tensor packed, int64_t n, int64_t group, int64_t bits,
                             c10::optional<at::Tensor> bias);

}  // namespace streamq
