// The embedded engine's decode-step kernels on CPU: attention (one query per row over that row's
// cached keys and values, grouped-query heads, the rotary embedding and the cache write folded
// in) and RMSNorm. See training_core/engines/cpu_kernels.py for why.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {  // bfloat16: the high half of a float
  uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void store(float* p, int64_t i, float x) { p[i] = x; }
// A tensor's data as the kernels' element type: float, or bfloat16 as its 16 bits.
template <typename T>
T* data(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}
inline void store(uint16_t* p, int64_t i, float x) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if (std::isnan(x)) {
    p[i] = 0x7FC0;
    return;
  }
  bits += 0x7FFF + ((bits >> 16) & 1);
  p[i] = static_cast<uint16_t>(bits >> 16);
}

// exp for x <= 0 that the compiler vectorises (std::exp is a call per element): 2^n * e^y with
// n = round(x / ln 2) and |y| <= ln 2 / 2, e^y by its Taylor series to degree 7 (relative error
// below 1e-7 there); below -87 (a masked column's -inf included) exactly 0.
inline float exp_nonpositive(float x) {
  const float c = std::max(x, -87.0f);
  const float n = std::nearbyint(c * 1.44269504088896341f);
  const float y = (c - n * 0.693359375f) + n * 2.12194440e-4f;  // c - n ln 2, in two parts
  float p = 1.0f / 5040;
  p = p * y + 1.0f / 720;
  p = p * y + 1.0f / 120;
  p = p * y + 1.0f / 24;
  p = p * y + 1.0f / 6;
  p = p * y + 0.5f;
  p = p * y + 1.0f;
  p = p * y + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.0f ? 0.0f : p * scale;
}

// Sixteen floats (one AVX-512 register; two AVX2 ones): GCC's vector extensions, so that the
// accumulators live in registers (plain float arrays were spilled to the stack every step).
typedef float vfloat __attribute__((vector_size(64)));
typedef uint32_t vbits __attribute__((vector_size(64)));
typedef uint16_t vhalf __attribute__((vector_size(32)));
constexpr int64_t LANES = 16;

inline vfloat loadv(const float* p) {
  vfloat r;
  std::memcpy(&r, p, sizeof r);
  return r;
}
inline vfloat loadv(const uint16_t* p) {  // sixteen bfloat16 values
  vhalf h;
  std::memcpy(&h, p, sizeof h);
  const vbits bits = __builtin_convertvector(h, vbits) << 16;
  vfloat r;
  std::memcpy(&r, &bits, sizeof r);
  return r;
}

// q [B, H, D], keys transposed kt [B, KV, D, C] (columns contiguous), values v [B, KV, C, D]
// (head dim contiguous), bias [B, C] (0 where a row attends, -inf elsewhere) -> out [B, H, D].
// Both products are broadcasts times contiguous vectors, accumulated in registers: scores four
// blocks of LANES columns at a time over the head dim, outputs over the head dim per column.
// Each loaded vector of keys or values serves GB query heads of the group at once (a load per
// multiply-add left the loops waiting on the cache), and the accumulators are independent (one
// chain of multiply-adds waits out each one's latency). No horizontal sums. D and GB are
// template arguments so that the loops over them unroll. Columns outside the row's first and
// last attended one are not read.
template <typename T, int64_t D, int64_t GB>
void attend(const T* q, const T* knew, const T* vnew, const float* cos, const float* sin, T* kt,
            T* v, const float* bias, T* out, int64_t B, int64_t H, int64_t KV, int64_t C,
            int64_t column, const int64_t* qs, const int64_t* ns, const int64_t* ms,
            const int64_t* ks, const int64_t* vs, int64_t bias_row, float scale) {
  static_assert(D % LANES == 0, "head size a multiple of LANES");
  constexpr int64_t DV = D / LANES, NB = 4;
  const int64_t G = H / KV;
  at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), scores(G * C);  // scores by absolute column, a row per head
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KV, h = task % KV;
      T* kb = kt + b * ks[0] + h * ks[1];
      T* vb = v + b * vs[0] + h * vs[1];
      // The step's own key and value into the cache first: the column's cache lines are read
      // below anyway (written from torch, the transposed keys' column was a scattered write
      // costing about as much as the attention itself).
      // The rotary embedding of the query and the new key here too, in fp32: x * cos +
      // roll(x, D / 2) * sin, with sin's first half negated by the caller (rotate_half's sign).
      const T* kn = knew + b * ns[0] + h * ns[1];
      const T* vn = vnew + b * ms[0] + h * ms[1];
      const float* cb = cos + b * D;
      const float* sb = sin + b * D;
      for (int64_t d = 0; d < D; ++d) {
        store(kb, d * ks[2] + column, load(kn, d) * cb[d] + load(kn, (d + D / 2) % D) * sb[d]);
        vb[column * vs[2] + d] = vn[d];
      }
      const float* mask = bias + b * bias_row;
      if (task + 1 < end) {  // the next pair's keys and values towards L2 while this one computes
        const int64_t nb = (task + 1) / KV, nh = (task + 1) % KV;
        const char* nk = reinterpret_cast<const char*>(kt + nb * ks[0] + nh * ks[1]);
        const char* nv = reinterpret_cast<const char*>(v + nb * vs[0] + nh * vs[1]);
        const int64_t krow = C * int64_t(sizeof(T)), vbytes = C * vs[2] * int64_t(sizeof(T));
        for (int64_t d = 0; d < D; ++d)
          for (int64_t x = 0; x < krow; x += 64)
            __builtin_prefetch(nk + d * ks[2] * sizeof(T) + x, 0, 2);
        for (int64_t x = 0; x < vbytes; x += 64) __builtin_prefetch(nv + x, 0, 2);
      }
      int64_t first = 0, last = C;  // attended columns lie in [first, last)
      while (first < C && mask[first] != 0.f) ++first;
      while (last > first && mask[last - 1] != 0.f) --last;
      for (int64_t g = 0; g < G; ++g) {
        const T* qg = q + b * qs[0] + (h * G + g) * qs[1];
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = (load(qg, d) * cb[d] + load(qg, (d + D / 2) % D) * sb[d]) * scale;
      }
      for (int64_t g0 = 0; g0 < G; g0 += GB) {
        const float* qq = qf.data() + g0 * D;
        float* sg = scores.data() + g0 * C;
        // Blocks of NB * LANES columns, then of LANES; a block that would pass the buffer's end
        // starts LANES before it instead (recomputing a few scores). Masked columns score their
        // bias, -inf, whatever the buffer holds there.
        int64_t c0 = first;
        for (; c0 + NB * LANES <= last; c0 += NB * LANES) {
          vfloat acc[GB][NB] = {};
          for (int64_t d = 0; d < D; ++d) {
            const T* kr = kb + d * ks[2] + c0;
            for (int64_t k = 0; k < NB; ++k) {
              const vfloat keys = loadv(kr + k * LANES);
              for (int64_t g = 0; g < GB; ++g) acc[g][k] += qq[g * D + d] * keys;
            }
          }
          for (int64_t k = 0; k < NB; ++k) {
            const vfloat m = loadv(mask + c0 + k * LANES);
            for (int64_t g = 0; g < GB; ++g) {
              const vfloat masked = m == 0.f ? acc[g][k] : m;
              std::memcpy(sg + g * C + c0 + k * LANES, &masked, sizeof(vfloat));
            }
          }
        }
        for (; c0 < last && C >= LANES; c0 += LANES) {
          const int64_t at = std::min(c0, C - LANES);
          vfloat acc[GB] = {};
          for (int64_t d = 0; d < D; ++d) {
            const vfloat keys = loadv(kb + d * ks[2] + at);
            for (int64_t g = 0; g < GB; ++g) acc[g] += qq[g * D + d] * keys;
          }
          const vfloat m = loadv(mask + at);
          for (int64_t g = 0; g < GB; ++g) {
            const vfloat masked = m == 0.f ? acc[g] : m;
            std::memcpy(sg + g * C + at, &masked, sizeof(vfloat));
          }
        }
        for (; c0 < last; ++c0) {  // a buffer narrower than LANES
          for (int64_t g = 0; g < GB; ++g) {
            float acc = 0.f;
            for (int64_t d = 0; d < D; ++d) acc += qq[g * D + d] * load(kb + c0, d * ks[2]);
            sg[g * C + c0] = mask[c0] == 0.f ? acc : mask[c0];
          }
        }
        float inv[GB];
        for (int64_t g = 0; g < GB; ++g) {
          float* row = sg + g * C;
          float peak = -INFINITY;
          for (int64_t c = first; c < last; ++c) peak = std::max(peak, row[c]);
          float total = 0.f;
#pragma omp simd reduction(+ : total)
          for (int64_t c = first; c < last; ++c) {
            row[c] = exp_nonpositive(row[c] - peak);
            total += row[c];
          }
          inv[g] = total > 0.f ? 1.f / total : 0.f;
        }
        vfloat acc[GB][DV] = {};
        for (int64_t c = first; c < last; ++c) {
          // a masked column (weight 0 for the whole group) is not read: whatever its value
          // holds, even nan, stays out of the sum
          bool attended = false;
          for (int64_t g = 0; g < GB; ++g) attended |= sg[g * C + c] != 0.f;
          if (!attended) continue;
          const T* vr = vb + c * vs[2];
          for (int64_t i = 0; i < DV; ++i) {
            const vfloat values = loadv(vr + i * LANES);
            for (int64_t g = 0; g < GB; ++g) acc[g][i] += sg[g * C + c] * values;
          }
        }
        for (int64_t g = 0; g < GB; ++g) {
          T* o = out + (b * H + h * G + g0 + g) * D;
          for (int64_t i = 0; i < DV; ++i)
            for (int64_t l = 0; l < LANES; ++l) store(o, i * LANES + l, acc[g][i][l] * inv[g]);
        }
      }
    }
  });
}

// q [B, H, D] and k_new [B, KV, D] before their rotary embedding, v_new [B, KV, D] (this step's
// key and value are written at ``column`` of the cache first); cos, sin [B, D] float32 (sin's
// first half negated); keys_t [B, KV, D, C] and values [B, KV, C, D], the cache (views into the
// engine's buffers); bias [B, C] float32, 0 where a row attends, -inf elsewhere -> [B, H, D].
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                            const at::Tensor& cos, const at::Tensor& sin, at::Tensor keys_t,
                            at::Tensor values, const at::Tensor& bias, int64_t column,
                            double scale) {
  TORCH_CHECK(q.dim() == 3 && k_new.dim() == 3 && v_new.dim() == 3 && keys_t.dim() == 4 &&
                  values.dim() == 4 && bias.dim() == 2,
              "q [B, H, D], k_new and v_new [B, KV, D], keys_t [B, KV, D, C], values [B, KV, C, "
              "D], bias [B, C]");
  for (const at::Tensor* t :
       std::initializer_list<const at::Tensor*>{&q, &k_new, &v_new, &keys_t, &values, &bias})
    TORCH_CHECK(t->device().is_cpu() && t->stride(-1) == 1, "CPU tensors, last dim contiguous");
  TORCH_CHECK(q.scalar_type() == keys_t.scalar_type() && q.scalar_type() == values.scalar_type() &&
                  q.scalar_type() == k_new.scalar_type() && q.scalar_type() == v_new.scalar_type(),
              "one dtype for q, keys and values");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "float32 or bfloat16");
  TORCH_CHECK(bias.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              "bias, cos and sin: float32");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.dim() == 2 && cos.size(0) == q.size(0) && cos.size(1) == q.size(2),
              "cos and sin: [B, D], contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KV = keys_t.size(1),
                C = keys_t.size(3);
  TORCH_CHECK(KV > 0 && H % KV == 0 && keys_t.size(0) == B && keys_t.size(2) == D &&
                  values.size(0) == B && values.size(1) == KV && values.size(2) == C &&
                  values.size(3) == D && bias.size(0) == B && bias.size(1) == C &&
                  k_new.sizes() == v_new.sizes() && k_new.size(0) == B &&
                  k_new.size(1) == KV && k_new.size(2) == D,
              "shapes do not match");
  TORCH_CHECK(column >= 0 && column < C, "column outside the cache");
  auto out = at::empty({B, H, D}, q.options());
  const int64_t qs[2] = {q.stride(0), q.stride(1)};
  const int64_t ns[2] = {k_new.stride(0), k_new.stride(1)};
  const int64_t ms[2] = {v_new.stride(0), v_new.stride(1)};
  const int64_t ks[3] = {keys_t.stride(0), keys_t.stride(1), keys_t.stride(2)};
  const int64_t vs[3] = {values.stride(0), values.stride(1), values.stride(2)};
  const float s = static_cast<float>(scale);
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  const int64_t G = H / KV;
  const int64_t GB = G % 4 == 0 ? 4 : G % 3 == 0 ? 3 : G % 2 == 0 ? 2 : 1;
  auto run = [&](auto head, auto group) {
    constexpr int64_t HD = decltype(head)::value, GBC = decltype(group)::value;
    auto typed = [&](auto element) {
      using T = decltype(element);
      attend<T, HD, GBC>(data<T>(q), data<T>(k_new), data<T>(v_new), data<float>(cos),
                         data<float>(sin), data<T>(keys_t), data<T>(values), data<float>(bias),
                         data<T>(out), B, H, KV, C, column, qs, ns, ms, ks, vs, bias.stride(0),
                         s);
    };
    if (bf16)
      typed(uint16_t{});
    else
      typed(float{});
  };
  auto by_group = [&](auto head) {
    switch (GB) {
      case 4: run(head, std::integral_constant<int64_t, 4>{}); break;
      case 3: run(head, std::integral_constant<int64_t, 3>{}); break;
      case 2: run(head, std::integral_constant<int64_t, 2>{}); break;
      default: run(head, std::integral_constant<int64_t, 1>{});
    }
  };
  switch (D) {
    case 16: by_group(std::integral_constant<int64_t, 16>{}); break;
    case 32: by_group(std::integral_constant<int64_t, 32>{}); break;
    case 64: by_group(std::integral_constant<int64_t, 64>{}); break;
    case 128: by_group(std::integral_constant<int64_t, 128>{}); break;
    default: TORCH_CHECK(false, "head size ", D, " is not one of 16, 32, 64, 128");
  }
  return out;
}

// transformers' LlamaRMSNorm in one call: weight * dtype(h * rsqrt(mean(h^2) + eps)), the norm
// in fp32 and rounded to the model's dtype before the weight's product (rounded again), as
// transformers orders it. hidden [B, N], weight [N], one dtype. torch's rms_norm on CPU ran as
// five operators (pow, mean, add, rsqrt, mul), with the casts and the weight's product eight:
// 3.8 ms of a SmolLM2 bf16 step at 64 rows for its 61 norms.
template <typename T>
void normalize(const T* h, const T* w, T* out, int64_t B, int64_t N, int64_t row, float eps) {
  at::parallel_for(0, B, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const T* x = h + b * row;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < N; ++i) squares += load(x, i) * load(x, i);
      const float r = 1.0f / std::sqrt(squares / N + eps);
      T* o = out + b * N;
      for (int64_t i = 0; i < N; ++i) {
        T normed;
        store(&normed, 0, load(x, i) * r);
        store(o, i, load(w, i) * load(&normed, 0));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& hidden, const at::Tensor& weight, double eps) {
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 1 && hidden.size(1) == weight.size(0),
              "hidden [B, N], weight [N]");
  TORCH_CHECK(hidden.device().is_cpu() && hidden.stride(1) == 1 && weight.is_contiguous(),
              "CPU tensors, last dim contiguous");
  TORCH_CHECK(hidden.scalar_type() == weight.scalar_type() &&
                  (hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16),
              "hidden and weight: one dtype, float32 or bfloat16");
  const int64_t B = hidden.size(0), N = hidden.size(1);
  auto out = at::empty({B, N}, hidden.options());
  auto typed = [&](auto element) {
    using T = decltype(element);
    normalize<T>(data<T>(hidden), data<T>(weight), data<T>(out), B, N, hidden.stride(0),
                 static_cast<float>(eps));
  };
  if (hidden.scalar_type() == at::kFloat)
    typed(float{});
  else
    typed(uint16_t{});
  return out;
}

}  // namespace

TORCH_LIBRARY(oolong, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor cos, Tensor sin, "
      "Tensor(a!) keys_t, Tensor(b!) values, Tensor bias, int column, float scale) -> Tensor");
  m.def("rms_norm(Tensor hidden, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("decode_attention", c10::DispatchKey::CPU, &decode_attention);
}
