// A decode step's transformer layers in one call, on the engine's own kernels: per layer the
// input norm, q/k/v in one projection, attention (rotary embedding and cache write included),
// the output projection with the residual added, the post-attention norm, gate and up with SiLU
// and the product, and the down projection with the residual added; see fused_decode.py.
//
// The same operators in the same order as FusedDecoder's loop over the layers in Python, so the
// same result bit for bit. What it saves is the loop: at 64 rows a SmolLM2 step ran 210 kernel
// calls from Python, each with its argument parsing, its dispatch and the views between them,
// while the other thread waited. The projection kernel is named, not linked: AMX's, AVX-512's or
// AVX2's (one signature), each in its own translation unit, reached through the dispatcher.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>

namespace {

using Linear = at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                          c10::string_view);
using Attention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, at::Tensor, at::Tensor,
                             const at::Tensor&, int64_t, double);
using Norm = at::Tensor(const at::Tensor&, const at::Tensor&, double);

template <typename F>
c10::TypedOperatorHandle<F> op(const std::string& name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(("oolong::" + name).c_str(), "").typed<F>();
}

// h [B, hidden] (the residual stream, the model's dtype) after every layer. Per layer i:
// input_norms[i], post_norms[i] [hidden]; qkv[i], o[i], gate_up[i] (gate and up interleaved),
// down[i] packed for ``linear`` ("amx_linear", "avx512_linear" or "avx2_linear"); key_blocks
// [layers, B, KV, C / 32, D, 32] and values [layers, B, KV, C, D], the slot cache's buffers
// (written at ``column``); cos, sin [B, D] float32, bias [B, C] float32 as decode_attention takes
// them. eps and scale are every layer's (the caller checks they are one).
at::Tensor decode_layers(const at::Tensor& h_in, at::TensorList input_norms,
                         at::TensorList post_norms, double eps, at::TensorList qkv, at::TensorList o,
                         at::TensorList gate_up, at::TensorList down, c10::string_view linear_name,
                         const at::Tensor& cos, const at::Tensor& sin, at::Tensor key_blocks,
                         at::Tensor values, const at::Tensor& bias, int64_t column, double scale,
                         int64_t heads, int64_t kv_heads) {
  const int64_t layers = static_cast<int64_t>(qkv.size());
  TORCH_CHECK(h_in.dim() == 2, "h: [B, hidden]");
  TORCH_CHECK(static_cast<int64_t>(input_norms.size()) == layers &&
                  static_cast<int64_t>(post_norms.size()) == layers &&
                  static_cast<int64_t>(o.size()) == layers &&
                  static_cast<int64_t>(gate_up.size()) == layers &&
                  static_cast<int64_t>(down.size()) == layers,
              "one norm weight and packed projection of each kind per layer");
  TORCH_CHECK(key_blocks.dim() == 6 && values.dim() == 5 && key_blocks.size(0) == layers &&
                  values.size(0) == layers,
              "key_blocks [layers, B, KV, C / 32, D, 32], values [layers, B, KV, C, D]");
  const std::string name(linear_name);
  TORCH_CHECK(name == "amx_linear" || name == "avx512_linear" || name == "avx2_linear",
              "linear: amx_linear, avx512_linear or avx2_linear, got ", name);
  static const auto attend = op<Attention>("decode_attention");
  static const auto norm = op<Norm>("rms_norm");
  const auto linear = op<Linear>(name);
  const int64_t b = h_in.size(0), dim = values.size(4);
  const c10::optional<at::Tensor> none;
  at::Tensor h = h_in;
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor x = norm.call(h, input_norms[i], eps);
    const at::Tensor qkv_out = linear.call(x, qkv[i], none, "none").view({b, heads + 2 * kv_heads, dim});
    const at::Tensor out =
        attend.call(qkv_out.narrow(1, 0, heads), qkv_out.narrow(1, heads, kv_heads),
                    qkv_out.narrow(1, heads + kv_heads, kv_heads), cos, sin, key_blocks.select(0, i),
                    values.select(0, i), bias, column, scale);
    h = linear.call(out.reshape({b, heads * dim}), o[i], h, "add");
    const at::Tensor y = norm.call(h, post_norms[i], eps);
    h = linear.call(linear.call(y, gate_up[i], none, "silu_mul"), down[i], h, "add");
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(oolong, m) {
  m.def(
      "decode_layers(Tensor h, Tensor[] input_norms, Tensor[] post_norms, float eps, Tensor[] qkv, "
      "Tensor[] o, Tensor[] gate_up, Tensor[] down, str linear, Tensor cos, Tensor sin, "
      "Tensor(a!) key_blocks, Tensor(b!) values, Tensor bias, int column, float scale, int heads, "
      "int kv_heads) -> Tensor");
  m.impl("decode_layers", c10::DispatchKey::CPU, &decode_layers);
}
