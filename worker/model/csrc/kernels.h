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

// paged_attention.cpp: each listed query token over its sequence's cached keys, read in place.
// `positions`: each token's own position, where its sliding window ends (none: context - 1; a
// token may see keys past it, as Gemma 3's image tokens see the rest of their image). `isa`:
// "auto" (the widest), "avx512", "avx2" or "portable", the same bits on each.
void paged_attention(at::Tensor q, at::Tensor out, at::Tensor tokens, at::Tensor rows, at::Tensor context,
                     at::Tensor tables, at::Tensor k_cache, at::Tensor v_cache, double scale, int64_t window,
                     const c10::optional<at::Tensor>& positions = c10::nullopt, const std::string& isa = "auto");

// panel_linear.cpp: float weights in panels of 32 columns.
bool panels_for(at::ScalarType dtype, Isa isa);
std::vector<std::string> panel_dtypes(const std::string& isa);
at::Tensor pack_panels(at::Tensor w);
at::Tensor panel_linear(at::Tensor x, at::Tensor panels, int64_t n, c10::optional<at::Tensor> bias,
                        const std::string& isa);

// quant_linear.cpp: weights of 4- or 8-bit codes with group-wise scales (worker/model/quantized.py).
at::Tensor pack_quantized(at::Tensor q, at::Tensor scale, c10::optional<at::Tensor> offset, int64_t bits);
at::Tensor quant_linear(at::Tensor x, at::Tensor packed, int64_t n, int64_t group, int64_t bits,
                        c10::optional<at::Tensor> bias, const std::string& isa);

// What both quantized kernels share (quant_linear.cpp). The bytes of one panel's group: its codes,
// then 32 scales, then 32 offsets where the weight has them.
inline int64_t group_bytes(int64_t group, int64_t bits, bool offset) {
  return group * 32 * bits / 8 + 32 * 4 * (offset ? 2 : 1);
}
// Where a packing puts the `group` codes of panel column j (0..31) in its group's bytes.
using PlaceCode = void (*)(uint8_t* block, int64_t j, const int8_t* codes, int64_t group, int64_t bits);
// The checks of a pack_quantized*'s arguments: q [N, K] int8 (4-bit: 0..15), scale and offset [N, K / group].
void check_pack(const at::Tensor& q, const at::Tensor& scale, const c10::optional<at::Tensor>& offset, int64_t bits);
// The checked arguments of a pack_quantized*: codes q [N, K], scale and offset [N, K / group], each
// group's codes placed by `place` and followed by its scales and offsets.
at::Tensor pack_groups(at::Tensor q, at::Tensor scale, c10::optional<at::Tensor> offset, int64_t bits, PlaceCode place);
// Where a packing reads it back: the code of panel column j (0..31), row i of its group.
using ReadCode = int (*)(const uint8_t* block, int64_t j, int64_t i, int64_t bits);
// Rows `rows` (int64) of a packed weight in groups of `group`, dequantized to float32 [len(rows), K]:
// code * scale - offset, as worker/model/quantized.py's dequantize computes it.
at::Tensor unpack_rows(const at::Tensor& packed, const at::Tensor& rows, int64_t group, int64_t bits, ReadCode read);
at::Tensor quantized_rows(at::Tensor packed, at::Tensor rows, int64_t group, int64_t bits);
// The checks of a quant_linear* call (`name`, of the weight packed by `packer`): x float32 or
// bfloat16, packed in groups of `group` of a weight [n, K], the bias; whether the weight has offsets.
bool check_quant_call(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t group, int64_t bits,
                      const c10::optional<at::Tensor>& bias, const char* name, const char* packer);

// quant_linear_int8.cpp: the same weights in VNNI's layout, x rounded to int8 ("avx512vnni"). With
// `steps` (and `offset_steps`) [N, groups / per]: the super-block packing, each group's scale (and
// offset) an int8 multiple of its column's step, `per` groups a step; its calls pass `per`.
at::Tensor pack_quantized_int8(at::Tensor q, at::Tensor scale, c10::optional<at::Tensor> offset, int64_t bits,
                               c10::optional<at::Tensor> steps, c10::optional<at::Tensor> offset_steps);
at::Tensor quant_linear_int8(at::Tensor x, at::Tensor packed, int64_t n, int64_t group, int64_t bits,
                             c10::optional<at::Tensor> bias, int64_t per);
at::Tensor quantized_int8_rows(at::Tensor packed, at::Tensor rows, int64_t group, int64_t bits, int64_t per);

}  // namespace streamq
