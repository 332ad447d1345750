// The engine's linear layers on AVX-512 CPUs (bf16 where AMX is absent, fp32 everywhere):
// out[M, N] = x[M, K] . W[N, K]^T
// with the decode step's epilogues fused (a residual add; SiLU(gate) * up), as amx_linear.cpp.
// bf16 is multiplied one of two ways, whichever this CPU runs faster (dot_pairs_faster):
// - widened: fp32 multiply-adds of the bf16 values widened in registers. On the Xeons measured
//   without AMX, AVX512-BF16's vdpbf16ps issues at half the rate of an fp32 FMA (two cores: 162
//   against 345 GFLOPS), so oneDNN's bf16 matmul topped out at ~150 GFLOPS, no faster than fp32.
// - in pairs: vdpbf16ps on pairs of k, where it issues as fast as an FMA (AMD's Zen 4), so twice
//   the products per instruction.
// Either way a bf16 product is exact in fp32 and the sums are fp32; only their order differs
// from oneDNN's. (In pairs, subnormal bf16 inputs count as zero, vdpbf16ps's rule: below 1e-38,
// which a model's weights and activations are not.) See training_core/rollout_server/fused_decode.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "projection_epilogue.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define OOLONG_AVX512_LINEAR 1
#include <immintrin.h>
#endif

namespace {

using namespace oolong_projection;

// A packed panel: 32 output columns by all of K, 32 values per k, in one of three layouts:
// - Widened (bf16): per k one 64-byte line whose 32-bit lane i holds column i in its low half
//   and column 16 + i in its high half (a shift and a mask widen it into the two vectors);
// - Pairs (bf16): per pair of k two lines, columns 0-15 then 16-31, lane i holding column i's
//   two k, the even one low (vdpbf16ps's operand); the packed tensor is [N / 32, K / 2, 64];
// - Fp32: per k two lines, columns 0-15 then 16-31.
constexpr int64_t COLS = 32;
constexpr int MAX_ROWS = 12;  // rows of x per pass over a panel: 24 accumulators in registers

#ifdef OOLONG_AVX512_LINEAR

// Each layout: W the packed weight's element, X the element of x a step reads per row (a float,
// or a pair of bf16 as 32 bits), Out the output's; a step is one k (or one pair) of the panel.
struct Widened {
  using W = uint16_t;
  using X = float;
  using Out = uint16_t;
  static constexpr int64_t kStepBytes = 64;
  static constexpr int64_t kChunkBytes = 8192;  // see linear()
  static void load(const W* panel, int64_t s, __m512& lo, __m512& hi) {
    const __m512i w = _mm512_loadu_si512(panel + s * COLS);
    lo = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    hi = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  static __m512 madd(X a, __m512 w, __m512 acc) { return _mm512_fmadd_ps(_mm512_set1_ps(a), w, acc); }
};

struct Pairs {
  using W = uint16_t;
  using X = uint32_t;
  using Out = uint16_t;
  static constexpr int64_t kStepBytes = 128;
  // AMD's (the CPUs that take pairs) read a pass's panel from L2 at the rate it is multiplied:
  // on a Zen 5 EPYC SmolLM2's projections at 64 rows took 14.3-14.6 ms in chunks of 64 KB (the
  // whole panel for K up to 1,024) against 16.3-16.8 in chunks of 8 KB, which store and reload
  // the partial sums at four chunk boundaries per panel for K = 576 (16 rows: the same). On a
  // Zen 4 EPYC (half Zen 5's bf16 rate, the same 1 MB L2), with lm_head: 44.9-51.5 ms against
  // 54.4-55.2 at 64 rows, 17.0-17.7 against 18.5-20.8 at 16 (docs/rollout-engine-and-precision.md)
  static constexpr int64_t kChunkBytes = 65536;
  static void load(const W* panel, int64_t s, __m512& lo, __m512& hi) {
    lo = _mm512_castsi512_ps(_mm512_loadu_si512(panel + s * 2 * COLS));
    hi = _mm512_castsi512_ps(_mm512_loadu_si512(panel + s * 2 * COLS + COLS));
  }
  static __m512 madd(X a, __m512 w, __m512 acc) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(a)), (__m512bh)w);
  }
};

struct Fp32 {
  using W = float;
  using X = float;
  using Out = float;
  static constexpr int64_t kStepBytes = 128;
  static constexpr int64_t kChunkBytes = 8192;
  static void load(const W* panel, int64_t s, __m512& lo, __m512& hi) {
    lo = _mm512_loadu_ps(panel + s * COLS);
    hi = _mm512_loadu_ps(panel + s * COLS + 16);
  }
  static __m512 madd(X a, __m512 w, __m512 acc) { return _mm512_fmadd_ps(_mm512_set1_ps(a), w, acc); }
};

// steps per chunk of a panel: kChunkBytes of it (widened bf16 128 k, pairs 512 pairs, fp32 64 k)
template <typename L>
constexpr int64_t depth() {
  return L::kChunkBytes / L::kStepBytes;
}

// R rows of x (``steps`` X per row) against one panel over steps [s0, s1): the sums so far come
// from ``partial`` (R x 32 floats) unless s0 is 0, and go back there unless s1 is the last
// step, where the epilogue writes the rows out.
template <int R, typename L>
void rows_by_panel(const typename L::X* x, int64_t steps, int64_t s0, int64_t s1,
                   const typename L::W* panel, float* partial, bool ahead, int64_t p, int64_t m0,
                   typename L::Out* out, const typename L::Out* other, Epilogue epi,
                   int64_t ld_out) {
  __m512 lo[R], hi[R];
  for (int r = 0; r < R; ++r) {
    lo[r] = s0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(partial + r * COLS);
    hi[r] = s0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(partial + r * COLS + 16);
  }
  for (int64_t s = s0; s < s1; ++s) {
    // the first pass over a chunk fetches the next chunk as it goes (the weights stream from
    // memory once per call; the prefetch may run past the weight's end, which is harmless)
    if (ahead) {
      const char* next = reinterpret_cast<const char*>(panel) + (s + depth<L>()) * L::kStepBytes;
      for (int64_t line = 0; line < L::kStepBytes / 64; ++line)
        _mm_prefetch(next + 64 * line, _MM_HINT_T0);
    }
    __m512 w_lo, w_hi;
    L::load(panel, s, w_lo, w_hi);
    for (int r = 0; r < R; ++r) {
      const typename L::X a = x[r * steps + s];
      lo[r] = L::madd(a, w_lo, lo[r]);
      hi[r] = L::madd(a, w_hi, hi[r]);
    }
  }
  if (s1 < steps) {
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(partial + r * COLS, lo[r]);
      _mm512_storeu_ps(partial + r * COLS + 16, hi[r]);
    }
    return;
  }
  for (int r = 0; r < R; ++r) write_row(lo[r], hi[r], epi, m0 + r, p, out, other, ld_out);
}

template <typename L, int R = MAX_ROWS>
void dispatch_rows(int rows, const typename L::X* x, int64_t steps, int64_t s0, int64_t s1,
                   const typename L::W* panel, float* partial, bool ahead, int64_t p, int64_t m0,
                   typename L::Out* out, const typename L::Out* other, Epilogue epi,
                   int64_t ld_out) {
  if constexpr (R > 0) {
    if (rows == R)
      return rows_by_panel<R, L>(x, steps, s0, s1, panel, partial, ahead, p, m0, out, other, epi,
                                 ld_out);
    dispatch_rows<L, R - 1>(rows, x, steps, s0, s1, panel, partial, ahead, p, m0, out, other,
                            epi, ld_out);
  }
}

// x . a packed weight into out, every panel, on torch's threads.
template <typename L>
void linear(const typename L::X* x, const typename L::W* w, typename L::Out* out,
            const typename L::Out* other, Epilogue epi, int64_t M, int64_t steps, int64_t N,
            int64_t ld_out) {
  // passes of at most MAX_ROWS rows, as even as they can be (64 rows: 11, 11, 11, 11, 10, 10)
  const int64_t passes = (M + MAX_ROWS - 1) / MAX_ROWS;
  const int64_t panel_size = steps * L::kStepBytes / static_cast<int64_t>(sizeof(typename L::W));
  // K in chunks, every pass of rows over a chunk before the next: widened or fp32, the chunk of
  // the panel (8 KB) and the pass's rows of x stay in L1. On a Xeon, widened, over all of K at
  // once a pass read x's rows and the panel (36-96 KB for SmolLM2 in bf16) from L2: 185 against
  // 230+ GFLOPS at 64 rows. Pairs take chunks of 64 KB, read from L2 (see Pairs); their
  // prefetch then runs a chunk ahead, into the thread's next panels (or the other thread's).
  at::parallel_for(0, N / COLS, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> partial(M * COLS);
    for (int64_t p = begin; p < end; ++p) {
      const typename L::W* panel = w + p * panel_size;
      for (int64_t s0 = 0; s0 < steps; s0 += depth<L>()) {
        const int64_t s1 = std::min(steps, s0 + depth<L>());
        for (int64_t i = 0, m0 = 0; i < passes; ++i) {
          const int rows = static_cast<int>((M - m0) / (passes - i));
          dispatch_rows<L>(rows, x + m0 * steps, steps, s0, s1, panel, partial.data() + m0 * COLS,
                           i == 0, p, m0, out, other, epi, ld_out);
          m0 += rows;
        }
      }
    }
  });
}

// Seconds for ``n`` rounds of twelve independent vdpbf16ps (pairs) or FMAs: their issue rates.
double issue_time(bool pairs, int64_t n) {
  __m512 acc[12];
  for (auto& a : acc) a = _mm512_setzero_ps();
  // 1.0: no denormal in sight (their assists would time something else); as bf16 pairs, 0 and 1
  const __m512 w = _mm512_set1_ps(1.f);
  const auto start = std::chrono::steady_clock::now();
  if (pairs) {
    for (int64_t i = 0; i < n; ++i)
      for (int r = 0; r < 12; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)w, (__m512bh)w);
  } else {
    for (int64_t i = 0; i < n; ++i)
      for (int r = 0; r < 12; ++r) acc[r] = _mm512_fmadd_ps(acc[r], w, w);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (auto& a : acc) asm volatile("" : : "v"(a));  // the sums are used: the loops stay
  return seconds;
}

#endif  // OOLONG_AVX512_LINEAR

// Whether bf16 is faster multiplied in pairs (vdpbf16ps issues at least at two thirds of an FMA's
// rate: twice the products per instruction then outweighs the widening's loads) than widened.
// Measured once per process, ~1 ms: the best of five rounds each, taken in turns.
bool dot_pairs_faster() {
#ifdef OOLONG_AVX512_LINEAR
  static const bool faster = [] {
    double pairs = 1e9, fma = 1e9;
    for (int round = 0; round < 5; ++round) {
      pairs = std::min(pairs, issue_time(true, 20000));
      fma = std::min(fma, issue_time(false, 20000));
    }
    return pairs < 1.5 * fma;
  }();
  return faster;
#else
  return false;
#endif
}

bool avx512_linear_available() {
#ifdef OOLONG_AVX512_LINEAR
  return true;
#else
  return false;
#endif
}

// w [N, K] bf16 or fp32 (N a multiple of 32) -> the packed panels: [N / 32, K, 32], or with
// ``pairs`` (bf16, K even) [N / 32, K / 2, 64] (the layouts above).
at::Tensor avx512_pack(const at::Tensor& w, bool pairs) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat) &&
                  w.device().is_cpu(),
              "w: [N, K] bfloat16 or float32 on CPU");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % COLS == 0, "N must be a multiple of 32, got ", N);
  if (w.scalar_type() == at::kFloat) {  // [N / 32, 32, K] -> [N / 32, K, 32]
    TORCH_CHECK(!pairs, "pairs: bf16 weights only");
    return w.contiguous().view({N / COLS, COLS, K}).transpose(1, 2).contiguous();
  }
  if (pairs) {  // [N / 32, 2, 16, K / 2, 2] -> [N / 32, K / 2, 2, 16, 2]
    TORCH_CHECK(K % 2 == 0, "pairs: K must be even, got ", K);
    return w.contiguous().view({N / COLS, 2, 16, K / 2, 2}).permute({0, 3, 1, 2, 4}).contiguous().view(
        {N / COLS, K / 2, 2 * COLS});
  }
  // [N / 32, 2, 16, K] -> [N / 32, K, 16, 2]: column i and 16 + i side by side for each k
  return w.contiguous().view({N / COLS, 2, 16, K}).permute({0, 3, 2, 1}).contiguous().view(
      {N / COLS, K, COLS});
}

// x [M, K] . the packed weight -> [M, N], in the weight's dtype (bf16 or fp32); epilogue "none",
// "add" (other [M, N], added before the rounding) or "silu_mul" (each panel's first 16 columns
// a gate, its last 16 the up projection: [M, N / 2] = SiLU(gate) * up, in bf16 rounded as
// transformers rounds it: bf16(bf16(SiLU(gate)) * up)).
at::Tensor avx512_linear(const at::Tensor& x, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& other, c10::string_view epilogue) {
  TORCH_CHECK(avx512_linear_available(), "this build has no AVX-512 with bf16 conversions");
  const at::ScalarType dtype = packed.scalar_type();
  const bool pairs = packed.dim() == 3 && packed.size(2) == 2 * COLS && dtype == at::kBFloat16;
  TORCH_CHECK(packed.dim() == 3 && (packed.size(2) == COLS || pairs) &&
                  (dtype == at::kBFloat16 || dtype == at::kFloat) && packed.is_contiguous(),
              "packed: avx512_pack's [N / 32, K, 32] or [N / 32, K / 2, 64]");
  int64_t width = 0;
  const int64_t N = packed.size(0) * COLS;
  const Epilogue epi = checked_epilogue(x, N, other, epilogue, width, dtype);
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t packed_k = pairs ? 2 * packed.size(1) : packed.size(1);
  TORCH_CHECK(packed_k == K, "x has ", K, " columns, the weight ", packed_k);
  auto out = at::empty({M, width}, x.options());
#ifdef OOLONG_AVX512_LINEAR
  const auto* ext = other ? other->data_ptr() : nullptr;
  if (dtype == at::kFloat) {
    const at::Tensor xc = x.contiguous();
    linear<Fp32>(xc.data_ptr<float>(), packed.data_ptr<float>(), out.data_ptr<float>(),
                 static_cast<const float*>(ext), epi, M, K, N, width);
  } else if (pairs) {  // x's bf16 as they are, two k per 32 bits
    const at::Tensor xc = x.contiguous();
    linear<Pairs>(reinterpret_cast<const uint32_t*>(xc.data_ptr()),
                  reinterpret_cast<const uint16_t*>(packed.data_ptr()),
                  reinterpret_cast<uint16_t*>(out.data_ptr()), static_cast<const uint16_t*>(ext),
                  epi, M, K / 2, N, width);
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
  m.def("avx512_linear_available() -> bool", &avx512_linear_available);
  m.def("avx512_dot_pairs_faster() -> bool", &dot_pairs_faster);
  m.def("avx512_pack(Tensor w, bool pairs=False) -> Tensor");
  m.def("avx512_linear(Tensor x, Tensor packed, Tensor? other, str epilogue) -> Tensor");
  m.impl("avx512_pack", c10::DispatchKey::CPU, &avx512_pack);
  m.impl("avx512_linear", c10::DispatchKey::CPU, &avx512_linear);
}
