// The built-in engine's CPU step kernels: the parts of a llama-family layer between its matmuls.
//
// In eager torch a decode layer of a small model is ~70 tensor ops, most of them elementwise on
// a few KB, so the calls cost more than the arithmetic. These kernels do each stretch in one
// call, and attention reads the paged KV cache in place (no gathered copy of the context):
//   add_rms_norm   residual add and RMSNorm            (transformers' LlamaRMSNorm, op for op)
//   rope_cache     rotary on q and k, k and v written to their cache slots
//   paged_attention each query token over its sequence's cached keys, through the block table
//                  (paged_attention.cpp)
//   panel_linear   a projection over a weight packed in 32-column panels (panel_linear.cpp)
//   quant_linear   a projection over 4- or 8-bit codes with group-wise scales (quant_linear.cpp)
//
// Each follows the eager ops' roundings where it is cheap to (a bf16 result is rounded where the
// eager op would round it), so fp32 and bf16 results stay close to the modules'; sums run in
// fp32 in another order. Compiled at first use for this CPU (worker/model/kernels.py), with
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

#include "kernels.h"

namespace {

using namespace streamq;

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

template <typename T> inline T round_to(float x);
template <> inline float round_to<float>(float x) { return x; }
template <> inline c10::BFloat16 round_to<c10::BFloat16>(float x) { return c10::BFloat16(x); }

// x rounded to T and back: the value an eager op in dtype T would have stored.
template <typename T> inline float as_stored(float x) { return to_float(round_to<T>(x)); }

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

// oneDNN's matmul over a prepacked weight, the op worker/model/fused_layers.py's Weight calls.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias, std::string("none"), c10::List<c10::optional<at::Scalar>>(), std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// One projection as worker/model/fused_layers.py's Weight runs it: a float weight on its panels, on
// oneDNN's prepacked weight or on the plain matmul (F.linear's op); or quantized codes on
// quant_linear. Built in Python by the static constructors bound below.
struct Projection {
  at::Tensor w;                           // float [N, K]; undefined where quantized
  c10::optional<at::Tensor> packed, bias;  // oneDNN's prepacked weight, panels, or quantized codes
  int64_t n = 0, group = 0, bits = 0;     // bits > 0: quantized; else panels where isa is set
  std::string isa;
  int64_t per = 0;                         // quantized_int8's groups a super-block, or 0

  static Projection matmul(at::Tensor w, c10::optional<at::Tensor> packed, c10::optional<at::Tensor> bias) {
    return Projection{w, packed, bias, w.size(0), 0, 0, ""};
  }
  static Projection panels(at::Tensor panels, int64_t n, c10::optional<at::Tensor> bias, std::string isa) {
    return Projection{at::Tensor(), panels, bias, n, 0, 0, isa};
  }
  static Projection quantized(at::Tensor codes, int64_t n, int64_t group, int64_t bits, c10::optional<at::Tensor> bias,
                              std::string isa) {
    return Projection{at::Tensor(), codes, bias, n, group, bits, isa};
  }
  static Projection quantized_int8(at::Tensor codes, int64_t n, int64_t group, int64_t bits,
                                   c10::optional<at::Tensor> bias, int64_t per) {
    return Projection{at::Tensor(), codes, bias, n, group, bits, "avx512vnni", per};
  }

  at::Tensor operator()(const at::Tensor& x) const {
    if (bits && isa == "avx512vnni") return quant_linear_int8(x, *packed, n, group, bits, bias, per);
    if (bits) return quant_linear(x, *packed, n, group, bits, bias, isa);
    if (!isa.empty()) return panel_linear(x, *packed, n, bias, isa);
    return packed ? packed_linear(x, *packed, bias) : at::linear(x, w, bias);
  }
};

// A llama-family model's layers for a step of one token (one stream decoding): the same kernels
// and matmuls as the per-layer calls from Python, in one call, so the step pays no per-op Python
// overhead.
struct Layers {
  std::vector<at::Tensor> ln1, ln2;
  std::vector<Projection> qkv, o, gate_up, down;
  std::vector<int64_t> windows;  // each layer's sliding window, 0 where it attends to the whole context
  int64_t heads, kv_heads;
  double eps, scale;

  Layers(std::vector<at::Tensor> ln1, std::vector<at::Tensor> ln2, std::vector<Projection> qkv,
         std::vector<Projection> o, std::vector<Projection> gate_up, std::vector<Projection> down,
         std::vector<int64_t> windows, int64_t heads, int64_t kv_heads, double eps, double scale)
      : ln1(std::move(ln1)), ln2(std::move(ln2)), qkv(std::move(qkv)), o(std::move(o)), gate_up(std::move(gate_up)),
        down(std::move(down)), windows(std::move(windows)), heads(heads), kv_heads(kv_heads), eps(eps), scale(scale) {
    TORCH_CHECK(this->windows.size() == this->qkv.size(), "one window a layer");
  }

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
      paged_attention(q, attended, tokens, rows, context, tables, kc, vc, scale, windows[i]);
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
  namespace py = pybind11;
  m.def("add_rms_norm", &add_rms_norm, "out = rms_norm(h + y), h updated to h + y");
  m.def("rope_cache", &rope_cache, "rotary on q and k; k and v written to the cache");
  m.def("paged_attention", &paged_attention, "attention over the paged cache, read in place", py::arg("q"),
        py::arg("out"), py::arg("tokens"), py::arg("rows"), py::arg("context"), py::arg("tables"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("scale"), py::arg("window") = 0, py::arg("positions") = py::none(),
        py::arg("isa") = "auto");
  m.def("pack_panels", &pack_panels, "a weight [N, K] in 32-column panels, for panel_linear");
  m.def("panel_linear", &panel_linear, "x @ w.T (+ bias), w as pack_panels(w) and its row count (panel_dtypes)",
        py::arg("x"), py::arg("panels"), py::arg("n"), py::arg("bias"), py::arg("isa") = "auto");
  m.def("panel_dtypes_of", &panel_dtypes, "the dtypes panel_linear computes on an isa", py::arg("isa"));
  m.def("pack_quantized", &pack_quantized, "codes q [N, K] int8, scale and offset [N, K / group] -> quant_linear's "
        "packed weight", py::arg("q"), py::arg("scale"), py::arg("offset"), py::arg("bits"));
  m.def("pack_quantized_int8", &pack_quantized_int8, "pack_quantized's arguments -> quant_linear_int8's VNNI layout; "
        "with steps [N, groups / per] (and offset_steps), its super-blocks", py::arg("q"), py::arg("scale"),
        py::arg("offset"), py::arg("bits"), py::arg("steps") = py::none(), py::arg("offset_steps") = py::none());
  m.def("quant_linear_int8", &quant_linear_int8, "x @ w.T (+ bias), x rounded to int8 per row and group, w as "
        "pack_quantized_int8(...) and its row count (per: its groups a super-block, 0 for none)", py::arg("x"),
        py::arg("packed"), py::arg("n"), py::arg("group"), py::arg("bits"), py::arg("bias"), py::arg("per") = 0);
  m.def("quantized_rows", &quantized_rows, "rows (int64) of pack_quantized's weight, dequantized to float32 [T, K]",
        py::arg("packed"), py::arg("rows"), py::arg("group"), py::arg("bits"));
  m.def("quantized_int8_rows", &quantized_int8_rows, "rows (int64) of pack_quantized_int8's weight, dequantized to "
        "float32 [T, K]", py::arg("packed"), py::arg("rows"), py::arg("group"), py::arg("bits"), py::arg("per") = 0);
  m.def("quant_linear", &quant_linear, "x @ w.T (+ bias), w as pack_quantized(...) and its row count",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("group"), py::arg("bits"), py::arg("bias"),
        py::arg("isa") = "auto");
  py::class_<Projection>(m, "Projection")
      .def_static("matmul", &Projection::matmul, "a float weight, oneDNN-prepacked or not")
      .def_static("panels", &Projection::panels, "a float weight's panels (pack_panels)")
      .def_static("quantized", &Projection::quantized, "a quantized weight's codes (pack_quantized)")
      .def_static("quantized_int8", &Projection::quantized_int8, "a quantized weight's codes (pack_quantized_int8)")
      .def("__call__", &Projection::operator());
  py::class_<Layers>(m, "Layers")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<Projection>, std::vector<Projection>,
                    std::vector<Projection>, std::vector<Projection>, std::vector<int64_t>, int64_t, int64_t, double,
                    double>())
      .def("run", &Layers::run, "the layers of a one-token step");
  // The projection kernels' ISAs on this CPU, widest first ("auto" picks the first), and the
  // dtypes panel_linear computes on the widest: none where the list is empty (the portable path).
  m.attr("isas") = runnable_isas();
  m.attr("panel_dtypes") = panel_dtypes("auto");
}
