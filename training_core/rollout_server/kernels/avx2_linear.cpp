// The engine's linear layers on CPUs with AVX2 and FMA where the AVX-512 kernel is not built
// (no AVX-512 with bf16 conversions: AMD's Zen 2 and 3, Xeons before Cooper Lake): out[M, N] = x[M, K] . W[N, K]^T with the decode step's epilogues fused (a residual add;
// SiLU(gate) * up), as avx512_linear.cpp, on the same packed panels (``avx512_pack``'s fp32 and
// widened bf16 layouts: nothing in them is specific to AVX-512).
//
// Why a kernel of its own where oneDNN is there: at a decode step's 16-64 rows oneDNN's fp32
// linear on such a CPU is called once per projection with its post-op as a second pass over the
// output (the residual add, SiLU then the product), and blocks for larger M. Here each panel of
// 32 output columns by all of K streams once from memory in chunks of 8 KB that stay in L1 while
// every pass of rows reads them, and the epilogue is applied to the sums in registers.
//
// AVX2 has sixteen 256-bit registers, so a pass is at most six rows by sixteen of the panel's
// columns: twelve accumulators, two weight vectors and a broadcast of x (the classic 6x16 block).
// A panel is read as two halves, h = 0 and 1, each columns 8h-8h+7 and 16+8h-16+8h+7: in the
// widened bf16 layout those are one 32-byte half of a k's line (a shift and a mask widen it), and
// in silu_mul's interleaved weights they are a gate's columns and their up projection's, so a
// half's epilogue needs nothing from the other half. bf16 products are exact in fp32 and the sums
// fp32; only their order differs from oneDNN's.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "projection_epilogue.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#define OOLONG_AVX2_LINEAR 1
#include <immintrin.h>
#endif

namespace {

using namespace oolong_projection;

constexpr int64_t COLS = 32;  // a packed panel's output columns (avx512_pack)
constexpr int MAX_ROWS = 6;   // rows of x per pass over a half panel: twelve accumulators

#ifdef OOLONG_AVX2_LINEAR

// The packed layouts (avx512_linear.cpp): W the weight's element, Out the output's; a step is
// one k of the panel; load() gives half h's two vectors of eight columns (8h.., 16 + 8h..).
struct Widened {  // per k one 64-byte line, 32-bit lane i = column i (low half), 16 + i (high)
  using W = uint16_t;
  using Out = uint16_t;
  static constexpr int64_t kStepBytes = 64;
  static void load(const W* panel, int64_t s, int h, __m256& lo, __m256& hi) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + s * COLS + 16 * h));
    lo = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    hi = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};

struct Fp32 {  // per k 32 floats, the columns in order
  using W = float;
  using Out = float;
  static constexpr int64_t kStepBytes = 128;
  static void load(const W* panel, int64_t s, int h, __m256& lo, __m256& hi) {
    lo = _mm256_loadu_ps(panel + s * COLS + 8 * h);
    hi = _mm256_loadu_ps(panel + s * COLS + 16 + 8 * h);
  }
};

// steps per chunk of a panel: 8 KB of it (widened bf16 128 k, fp32 64 k)
template <typename L>
constexpr int64_t depth() {
  return 8192 / L::kStepBytes;
}

inline __m256 widen(const uint16_t* p) {  // eight bfloat16 -> float
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// eight floats -> bfloat16, rounded to nearest even as torch rounds (a NaN to 0x7FC0)
inline void narrow(__m256 x, uint16_t* p) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  // packus works within each 128-bit lane: r0-r3 r0-r3 | r4-r7 r4-r7; 64-bit words 0 and 2
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// e^x (x clamped to [-88, 88]), as exp512 in projection_epilogue.h; 2^n by the exponent's bits
// (at n = -127 that is 0 where scalef gives a subnormal: SiLU's 1 + e^-x cannot tell them apart)
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

inline __m256 silu(__m256 g) {
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

// Half h of row ``row`` of panel ``p`` (columns 8h.. in lo, 16 + 8h.. in hi, fp32 sums) into out
// through the epilogue, as projection_epilogue.h's write_row does for a whole panel.
inline void write_half(__m256 lo, __m256 hi, Epilogue epi, int64_t row, int64_t p, int h,
                       float* out, const float* other, int64_t ld_out) {
  if (epi == Epilogue::kSiluMul) {
    _mm256_storeu_ps(out + row * ld_out + p * 16 + 8 * h, _mm256_mul_ps(silu(lo), hi));
    return;
  }
  float* o = out + row * ld_out + p * COLS + 8 * h;
  if (epi == Epilogue::kAdd) {
    const float* e = other + row * ld_out + p * COLS + 8 * h;
    lo = _mm256_add_ps(lo, _mm256_loadu_ps(e));
    hi = _mm256_add_ps(hi, _mm256_loadu_ps(e + 16));
  }
  _mm256_storeu_ps(o, lo);
  _mm256_storeu_ps(o + 16, hi);
}

inline void write_half(__m256 lo, __m256 hi, Epilogue epi, int64_t row, int64_t p, int h,
                       uint16_t* out, const uint16_t* other, int64_t ld_out) {
  if (epi == Epilogue::kSiluMul) {  // bf16(bf16(SiLU(gate)) * up), as transformers rounds
    uint16_t s[8];
    narrow(silu(lo), s);
    narrow(_mm256_mul_ps(widen(s), hi), out + row * ld_out + p * 16 + 8 * h);
    return;
  }
  uint16_t* o = out + row * ld_out + p * COLS + 8 * h;
  if (epi == Epilogue::kAdd) {  // the residual, in fp32 before the one rounding
    const uint16_t* e = other + row * ld_out + p * COLS + 8 * h;
    lo = _mm256_add_ps(lo, widen(e));
    hi = _mm256_add_ps(hi, widen(e + 16));
  }
  narrow(lo, o);
  narrow(hi, o + 16);
}

// R rows' accumulators for half a panel: the row's columns 8h.. (lo) and 16 + 8h.. (hi), then
// the rows after it. Members of nested structs, not an array: GCC kept an array of twelve
// vectors on the stack, a store after every multiply-add, at half the speed; these it keeps in
// registers (twelve accumulators, two weight vectors and the broadcast: fifteen of sixteen).
template <int R>
struct Rows {
  __m256 lo, hi;
  Rows<R - 1> rest;
};
template <>
struct Rows<0> {};

template <int R>
inline void start(Rows<R>& a, const float* partial, int h, bool zero) {
  if constexpr (R > 0) {
    a.lo = zero ? _mm256_setzero_ps() : _mm256_loadu_ps(partial + 8 * h);
    a.hi = zero ? _mm256_setzero_ps() : _mm256_loadu_ps(partial + 16 + 8 * h);
    start(a.rest, partial + COLS, h, zero);
  }
}

template <int R>
inline void madd(Rows<R>& a, const float* x, int64_t steps, __m256 w_lo, __m256 w_hi) {
  if constexpr (R > 0) {
    const __m256 b = _mm256_broadcast_ss(x);
    a.lo = _mm256_fmadd_ps(b, w_lo, a.lo);
    a.hi = _mm256_fmadd_ps(b, w_hi, a.hi);
    madd(a.rest, x + steps, steps, w_lo, w_hi);
  }
}

template <int R>
inline void keep(const Rows<R>& a, float* partial, int h) {
  if constexpr (R > 0) {
    _mm256_storeu_ps(partial + 8 * h, a.lo);
    _mm256_storeu_ps(partial + 16 + 8 * h, a.hi);
    keep(a.rest, partial + COLS, h);
  }
}

template <int R, typename Out>
inline void finish(const Rows<R>& a, Epilogue epi, int64_t row, int64_t p, int h, Out* out,
                   const Out* other, int64_t ld_out) {
  if constexpr (R > 0) {
    write_half(a.lo, a.hi, epi, row, p, h, out, other, ld_out);
    finish(a.rest, epi, row + 1, p, h, out, other, ld_out);
  }
}

// R rows of x (fp32, ``steps`` per row) against half h of one panel over steps [s0, s1): the
// sums so far come from ``partial`` (R x 32 floats, the panel's column order) unless s0 is 0,
// and go back there unless s1 is the last step, where the epilogue writes the rows out.
template <int R, typename L>
void rows_by_half(const float* x, int64_t steps, int64_t s0, int64_t s1, const typename L::W* panel,
                  int h, float* partial, bool ahead, int64_t p, int64_t m0, typename L::Out* out,
                  const typename L::Out* other, Epilogue epi, int64_t ld_out) {
  Rows<R> acc;
  start(acc, partial, h, s0 == 0);
  for (int64_t s = s0; s < s1; ++s) {
    // the first pass over a chunk fetches the next chunk as it goes (the weights stream from
    // memory once per call; the prefetch may run past the weight's end, which is harmless)
    if (ahead) {
      const char* next = reinterpret_cast<const char*>(panel) + (s + depth<L>()) * L::kStepBytes;
      for (int64_t line = 0; line < L::kStepBytes / 64; ++line)
        _mm_prefetch(next + 64 * line, _MM_HINT_T0);
    }
    __m256 w_lo, w_hi;
    L::load(panel, s, h, w_lo, w_hi);
    madd(acc, x + s, steps, w_lo, w_hi);
  }
  if (s1 < steps)
    keep(acc, partial, h);
  else
    finish(acc, epi, m0, p, h, out, other, ld_out);
}

template <typename L, int R = MAX_ROWS>
void dispatch_rows(int rows, const float* x, int64_t steps, int64_t s0, int64_t s1,
                   const typename L::W* panel, int h, float* partial, bool ahead, int64_t p,
                   int64_t m0, typename L::Out* out, const typename L::Out* other, Epilogue epi,
                   int64_t ld_out) {
  if constexpr (R > 0) {
    if (rows == R)
      return rows_by_half<R, L>(x, steps, s0, s1, panel, h, partial, ahead, p, m0, out, other, epi,
                                ld_out);
    dispatch_rows<L, R - 1>(rows, x, steps, s0, s1, panel, h, partial, ahead, p, m0, out, other,
                            epi, ld_out);
  }
}

// x . a packed weight into out, every panel, on torch's threads: per panel, K in chunks that
// stay in L1, every pass of rows and both halves over a chunk before the next.
template <typename L>
void linear(const float* x, const typename L::W* w, typename L::Out* out,
            const typename L::Out* other, Epilogue epi, int64_t M, int64_t K, int64_t N,
            int64_t ld_out) {
  // passes of at most MAX_ROWS rows, as even as they can be (16 rows: 5, 5, 6)
  const int64_t passes = (M + MAX_ROWS - 1) / MAX_ROWS;
  const int64_t panel_size = K * L::kStepBytes / static_cast<int64_t>(sizeof(typename L::W));
  at::parallel_for(0, N / COLS, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> partial(M * COLS);
    for (int64_t p = begin; p < end; ++p) {
      const typename L::W* panel = w + p * panel_size;
      for (int64_t s0 = 0; s0 < K; s0 += depth<L>()) {
        const int64_t s1 = std::min(K, s0 + depth<L>());
        for (int64_t i = 0, m0 = 0; i < passes; ++i) {
          const int rows = static_cast<int>((M - m0) / (passes - i));
          for (int h = 0; h < 2; ++h)
            dispatch_rows<L>(rows, x + m0 * K, K, s0, s1, panel, h, partial.data() + m0 * COLS,
                             i == 0 && h == 0, p, m0, out, other, epi, ld_out);
          m0 += rows;
        }
      }
    }
  });
}

#endif  // OOLONG_AVX2_LINEAR

bool avx2_linear_available() {
#ifdef OOLONG_AVX2_LINEAR
  return true;
#else
  return false;
#endif
}

// x [M, K] . the packed weight (avx512_pack's [N / 32, K, 32], bf16 widened or fp32) -> [M, N] in
// the weight's dtype, with avx512_linear's epilogues: "none", "add" (other [M, N] added before
// the rounding) or "silu_mul" ([M, N / 2], each panel a gate's 16 columns and then up's).
at::Tensor avx2_linear(const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& other, c10::string_view epilogue) {
  TORCH_CHECK(avx2_linear_available(), "this build has no AVX2 with FMA");
  const at::ScalarType dtype = packed.scalar_type();
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == COLS &&
                  (dtype == at::kBFloat16 || dtype == at::kFloat) && packed.is_contiguous(),
              "packed: avx512_pack's [N / 32, K, 32] (not its pairs of k)");
  int64_t width = 0;
  const int64_t N = packed.size(0) * COLS;
  const Epilogue epi = checked_epilogue(x, N, other, epilogue, width, dtype);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.size(1) == K, "x has ", K, " columns, the weight ", packed.size(1));
  auto out = at::empty({M, width}, x.options());
#ifdef OOLONG_AVX2_LINEAR
  const auto* ext = other ? other->data_ptr() : nullptr;
  if (dtype == at::kFloat) {
    const at::Tensor xc = x.contiguous();
    linear<Fp32>(xc.data_ptr<float>(), packed.data_ptr<float>(), out.data_ptr<float>(),
                 static_cast<const float*>(ext), epi, M, K, N, width);
  } else {
    const at::Tensor xf = x.to(at::kFloat).contiguous();  // bf16 widened once, read per panel
    linear<Widened>(xf.data_ptr<float>(), reinterpret_cast<const uint16_t*>(packed.data_ptr()),
                    reinterpret_cast<uint16_t*>(out.data_ptr()), static_cast<const uint16_t*>(ext),
                    epi, M, K, N, width);
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(oolong, m) {
  m.def("avx2_linear_available() -> bool", &avx2_linear_available);
  m.def("avx2_linear(Tensor x, Tensor packed, Tensor? other, str epilogue) -> Tensor");
  m.impl("avx2_linear", c10::DispatchKey::CPU, &avx2_linear);
}
