// What the decode step's projection kernels share: the epilogues fused into them and their checks
// of the call (all three), and the row writer that applies them to one panel of 32 output columns
// held as two vectors of sixteen floats (amx_linear.cpp, avx512_linear.cpp; avx2_linear.cpp has
// its own for half a panel).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace oolong_projection {

enum class Epilogue { kNone, kAdd, kSiluMul };

// The call's epilogue and output width after checking x and other: "none", "add" (other [M, N]
// added before the rounding) or "silu_mul" (each panel's first 16 columns a gate, its last 16
// the up projection: [M, N / 2] = bf16(bf16(SiLU(gate)) * up)).
inline Epilogue checked_epilogue(const at::Tensor& x, int64_t N,
                                 const c10::optional<at::Tensor>& other,
                                 c10::string_view epilogue, int64_t& width,
                                 at::ScalarType dtype = at::kBFloat16) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype && x.device().is_cpu(),
              "x: [M, K] ", dtype == at::kBFloat16 ? "bfloat16" : "float32", " on CPU");
  // the kernels' sums start from the first k: with none, the output would be the memory's
  TORCH_CHECK(x.size(1) > 0, "x: [M, K] with K > 0, got K = 0");
  const std::string mode(epilogue);
  TORCH_CHECK(mode == "none" || mode == "add" || mode == "silu_mul",
              "epilogue must be none, add or silu_mul, got ", mode);
  const Epilogue epi = mode == "none" ? Epilogue::kNone
                       : mode == "add" ? Epilogue::kAdd
                                       : Epilogue::kSiluMul;
  width = epi == Epilogue::kSiluMul ? N / 2 : N;
  if (epi == Epilogue::kAdd)
    TORCH_CHECK(other && other->sizes() == at::IntArrayRef({x.size(0), N}) &&
                    other->is_contiguous() && other->scalar_type() == dtype,
                "add: other must be [M, N] ", dtype == at::kBFloat16 ? "bfloat16" : "float32",
                ", contiguous");
  return epi;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)

inline __m512 widen(__m256i bf16) {  // sixteen bfloat16 -> float
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
}

inline __m256i narrow(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }  // round to even

// e^x for every float x (clamped to [-88, 88]): 2^n * e^r, n = round(x / ln 2), e^r by its
// Taylor series to degree 7 (relative error below 2e-7), scaled by 2^n in one instruction.
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// Row ``row`` of panel ``p`` (its columns 0-15 in lo, 16-31 in hi, summed in fp32) into out,
// whose rows are ``ld_out`` wide, through the epilogue; other has out's layout ("add").
inline void write_row(__m512 lo, __m512 hi, Epilogue epi, int64_t row, int64_t p, uint16_t* out,
                      const uint16_t* other, int64_t ld_out) {
  if (epi == Epilogue::kSiluMul) {  // 16 outputs, rounded as transformers does in bf16:
    // SiLU(gate) to bf16, then the product
    const __m512 silu = _mm512_div_ps(
        lo, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), lo))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + row * ld_out + p * 16),
                        narrow(_mm512_mul_ps(widen(narrow(silu)), hi)));
    return;
  }
  uint16_t* o = out + row * ld_out + p * 32;
  if (epi == Epilogue::kAdd) {  // the residual, in fp32 before the one rounding
    const uint16_t* h = other + row * ld_out + p * 32;
    lo = _mm512_add_ps(lo, widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h))));
    hi = _mm512_add_ps(hi, widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 16))));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), narrow(lo));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16), narrow(hi));
}

// write_row for an fp32 model: the same epilogues, no rounding (transformers in fp32).
inline void write_row(__m512 lo, __m512 hi, Epilogue epi, int64_t row, int64_t p, float* out,
                      const float* other, int64_t ld_out) {
  if (epi == Epilogue::kSiluMul) {
    const __m512 silu = _mm512_div_ps(
        lo, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), lo))));
    _mm512_storeu_ps(out + row * ld_out + p * 16, _mm512_mul_ps(silu, hi));
    return;
  }
  float* o = out + row * ld_out + p * 32;
  if (epi == Epilogue::kAdd) {
    const float* h = other + row * ld_out + p * 32;
    lo = _mm512_add_ps(lo, _mm512_loadu_ps(h));
    hi = _mm512_add_ps(hi, _mm512_loadu_ps(h + 16));
  }
  _mm512_storeu_ps(o, lo);
  _mm512_storeu_ps(o + 16, hi);
}

#endif

}  // namespace oolong_projection
