// The embedded engine's decode-step kernels on CPU: attention (one query per row over that row's
// cached keys and values, grouped-query heads, the rotary embedding and the cache write folded
// in) and RMSNorm. See training_core/rollout_server/cpu_kernels.py for why.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
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

// One register of floats: sixteen on AVX-512, eight on AVX2. GCC's vector extensions, so that
// the accumulators live in registers (plain float arrays were spilled to the stack every step).
// A vector wider than the target's registers is not one: GCC lowered sixteen floats on AVX2 to
// memory, a broadcast as sixteen scalar stores and every accumulator copied through the stack
// (fp32 decode attention ran at 0.6x torch's on an AVX2 EPYC), hence the width per target, and
// AVX2's tiles sized for its sixteen registers (WIDE: AVX-512's thirty-two).
#ifdef __AVX512F__
constexpr int64_t LANES = 16;
constexpr bool WIDE = true;
#else
constexpr int64_t LANES = 8;
constexpr bool WIDE = false;
#endif
typedef float vfloat __attribute__((vector_size(LANES * 4)));
typedef uint32_t vbits __attribute__((vector_size(LANES * 4)));
typedef uint16_t vhalf __attribute__((vector_size(LANES * 2)));
constexpr int64_t BLOCK = 32;  // columns per block of the key cache (slot_cache.KEY_BLOCK)
constexpr int64_t SAMPLE_MULTIPLE = 16;  // the sampling kernel's blocks: whole vectors on every target

inline vfloat loadv(const float* p) {
  vfloat r;
  std::memcpy(&r, p, sizeof r);
  return r;
}
inline vfloat loadv(const uint16_t* p) {  // LANES bfloat16 values
  vhalf h;
  std::memcpy(&h, p, sizeof h);
  const vbits bits = __builtin_convertvector(h, vbits) << 16;
  vfloat r;
  std::memcpy(&r, &bits, sizeof r);
  return r;
}

// Thirty-two bfloat16 values as two float vectors: those at even positions and those at odd
// ones. A bfloat16 is a float's high half, so a shift and a mask widen sixteen each: half the
// work of widening sixteen in order (a shuffle and a shift), whose shuffle competed with the
// multiply-adds for a port. Exact: the same floats, in another order.
inline void load_pairs(const uint16_t* p, vfloat& even, vfloat& odd) {
  vbits w;
  std::memcpy(&w, p, sizeof w);
  const vbits e = w << 16, o = w & 0xFFFF0000u;
  std::memcpy(&even, &e, sizeof e);
  std::memcpy(&odd, &o, sizeof o);
}
// load_pairs' order undone: (e0 o0 ... e7 o7) into lo, (e8 o8 ... e15 o15) into hi.
inline void interleave(vfloat even, vfloat odd, vfloat& lo, vfloat& hi) {
#ifdef __AVX512F__
  lo = __builtin_shufflevector(even, odd, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  hi = __builtin_shufflevector(even, odd, 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30,
                               15, 31);
#else
  lo = __builtin_shufflevector(even, odd, 0, 8, 1, 9, 2, 10, 3, 11);
  hi = __builtin_shufflevector(even, odd, 4, 12, 5, 13, 6, 14, 7, 15);
#endif
}

// exp for x <= 0, on a float or on a vector's lanes alike (std::exp is a call per element): 2^n *
// e^y with n = round(x / ln 2) (the 1.5 * 2^23 trick, exact for |n| < 2^22) and |y| <= ln 2 / 2,
// e^y by its Taylor series to degree 7 (relative error below 1e-7 there); below -87 (a masked
// column's -inf included) exactly 0.
typedef int32_t vint __attribute__((vector_size(LANES * 4)));
inline int32_t as_int(float n) { return static_cast<int32_t>(n); }
inline vint as_int(vfloat n) { return __builtin_convertvector(n, vint); }
inline float as_float(int32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline vfloat as_float(vint bits) {
  vfloat f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
template <typename V>
inline V exp_nonpositive(V x) {
  const V floor87 = V{} - 87.0f, magic = V{} + 12582912.0f;
  const V c = x < floor87 ? floor87 : x;
  const V n = (c * 1.44269504088896341f + magic) - magic;
  const V y = (c - n * 0.693359375f) + n * 2.12194440e-4f;
  V p = V{} + 1.0f / 5040;
  p = p * y + 1.0f / 720;
  p = p * y + 1.0f / 120;
  p = p * y + 1.0f / 24;
  p = p * y + 1.0f / 6;
  p = p * y + 0.5f;
  p = p * y + 1.0f;
  p = p * y + 1.0f;
  const V r = p * as_float((as_int(n) + 127) << 23);
  return x < floor87 ? V{} : r;
}

// x * cos + roll(x, D / 2) * sin (the caller negated sin's first half: rotate_half's sign),
// times mult, in fp32 into out[D]; whole vectors where a half of D is a multiple of LANES.
template <typename T, int64_t D>
inline void rotate(const T* x, const float* cb, const float* sb, float mult, float* out) {
  if constexpr (D % (2 * LANES) == 0) {
    constexpr int64_t DV = D / LANES;
    vfloat xs[DV];
    for (int64_t i = 0; i < DV; ++i) xs[i] = loadv(x + i * LANES);
    for (int64_t i = 0; i < DV; ++i) {
      const vfloat r =
          (xs[i] * loadv(cb + i * LANES) + xs[(i + DV / 2) % DV] * loadv(sb + i * LANES)) * mult;
      std::memcpy(out + i * LANES, &r, sizeof r);
    }
  } else {
    for (int64_t d = 0; d < D; ++d)
      out[d] = (load(x, d) * cb[d] + load(x, (d + D / 2) % D) * sb[d]) * mult;
  }
}

// The next task's cache lines, fetched towards L2 from the current task's inner loops: its keys
// (one contiguous run of blocks) spread over the whole pass over the current task's keys, as
// many lines per iteration over the head dim as the iteration reads (AVX-512, two blocks: two
// in bf16, four in fp32; four in bf16 finished in the first half of the pass: 4-5% slower; AVX2,
// one vector of columns: one line every four or two iterations), and two lines of values per
// column.
struct Ahead {
  const int key_lines;  // lines per key() call that fetches
  const int key_every;  // 1: every call fetches; n: one call in n
  int calls = 0;
  const char* keys = nullptr;
  const char* keys_end = nullptr;
  const char* values = nullptr;
  const char* values_end = nullptr;

  void next(const char* k, int64_t k_bytes, const char* v, int64_t v_bytes) {
    keys = k, keys_end = k + k_bytes;
    values = v, values_end = v + v_bytes;
  }
  void key() {
    if (key_every > 1 && ++calls % key_every != 0) return;
    for (int i = 0; i < key_lines && keys < keys_end; ++i, keys += 64) __builtin_prefetch(keys, 0, 2);
  }
  void value() {
    if (values < values_end) {
      __builtin_prefetch(values, 0, 2);
      __builtin_prefetch(values + 64, 0, 2);
      values += 128;
    }
  }
  void flush() {
    for (; keys < keys_end; keys += 64) __builtin_prefetch(keys, 0, 2);
    for (; values < values_end; values += 64) __builtin_prefetch(values, 0, 2);
  }
};

// GB heads' scores, V vectors of columns from ``at``, into their rows of ``scores`` (C columns a
// head), in order; a masked column scores its bias (-inf) whatever its keys held.
template <int64_t GB, int64_t V>
inline void store_masked(const vfloat (&acc)[GB][V], const float* mask, int64_t at, float* scores,
                         int64_t C) {
  for (int64_t k = 0; k < V; ++k) {
    const vfloat m = loadv(mask + at + k * LANES);
    for (int64_t g = 0; g < GB; ++g) {
      const vfloat masked = m == 0.f ? acc[g][k] : m;
      std::memcpy(scores + g * C + at + k * LANES, &masked, sizeof(vfloat));
    }
  }
}

// 32 columns' scores from load_pairs' order into row[at, at + 32), in order (store_masked's rule)
inline void store_scores(vfloat even, vfloat odd, const float* mask, int64_t at, float* row) {
  vfloat part[1][2];
  interleave(even, odd, part[0][0], part[0][1]);
  store_masked(part, mask, at, row, 0);
}

// q [B, H, D]; keys in blocks of BLOCK columns kb [B, KV, C / BLOCK, D, BLOCK] (a block's columns
// of one dim contiguous, its dims one after another), values v [B, KV, C, D] (head dim
// contiguous), bias [B, C] (0 where a row attends, -inf elsewhere) -> out [B, H, D].
// Both products are broadcasts times contiguous vectors, accumulated in registers: scores two
// blocks of columns at a time over the head dim (AVX2: a vector of columns), outputs over the
// head dim per column.
// Each loaded vector of keys or values serves GB query heads of the group at once (a load per
// multiply-add left the loops waiting on the cache), and the accumulators are independent (one
// chain of multiply-adds waits out each one's latency). No horizontal sums. D and GB are
// template arguments so that the loops over them unroll. Blocks outside the row's first and last
// attended column are not read, and a task's blocks are one contiguous run: keys stored with
// columns contiguous over the whole buffer (the previous layout) were read at 9.8 GB/s from a
// buffer half again as wide as the window against 12.1-13.8 from one exactly as wide, the
// hardware prefetcher fetching the columns between one dim's run and the next.
template <typename T, int64_t D, int64_t GB>
void attend(const T* q, const T* knew, const T* vnew, const float* cos, const float* sin, T* kt,
            T* v, const float* bias, T* out, int64_t B, int64_t H, int64_t KV, int64_t C,
            int64_t column, const int64_t* qs, const int64_t* ns, const int64_t* ms,
            const int64_t* ks, const int64_t* vs, int64_t bias_row, float scale) {
  static_assert(D % LANES == 0, "head size a multiple of LANES");
  constexpr int64_t DV = D / LANES, PAIR = 2 * LANES, SPAN = D * BLOCK;  // SPAN: one block
  // bf16 keys as pairs (a block is one pair of AVX-512 vectors); on AVX2 widened in order
  constexpr bool key_pairs = std::is_same_v<T, uint16_t> && WIDE;
  static_assert(!key_pairs || BLOCK == PAIR, "a block is one pair of vectors of bf16 columns");
  const int64_t G = H / KV;
  // scores' vectors per iteration where not two blocks (below): AVX2 keeps GB x NV <= 8
  // accumulators of its sixteen registers, a whole number of them per block
  constexpr int64_t NV = WIDE ? 1 : std::max<int64_t>(1, std::min<int64_t>(BLOCK / LANES, 8 / GB));
  at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), scores(G * C);  // scores by absolute column, a row per head
    // A row's attended columns [first, last), scanned from its bias once for its KV tasks
    int64_t scanned = -1, row_first = 0, row_last = 0;
    auto attended = [&](int64_t row, int64_t& lo, int64_t& hi) {
      if (row != scanned) {
        const float* m = bias + row * bias_row;
        row_first = 0, row_last = C;
        while (row_first < C && m[row_first] != 0.f) ++row_first;
        while (row_last > row_first && m[row_last - 1] != 0.f) --row_last;
        scanned = row;
      }
      lo = row_first, hi = row_last;
    };
    // the bytes of keys an iteration reads: two blocks' (AVX-512) or NV vectors' (AVX2)
    constexpr int64_t step_bytes = (WIDE ? 2 * BLOCK : NV * LANES) * static_cast<int64_t>(sizeof(T));
    Ahead ahead{static_cast<int>(std::max<int64_t>(1, step_bytes / 64)),
                static_cast<int>(std::max<int64_t>(1, 64 / step_bytes))};
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / KV, h = task % KV;
      T* kb = kt + b * ks[0] + h * ks[1];
      T* vb = v + b * vs[0] + h * vs[1];
      // The step's own key and value into the cache first: the column's cache lines are read
      // below anyway (written from torch, the key's column was a scattered write costing about
      // as much as the attention itself).
      // The rotary embedding of the query and the new key here too, in fp32: x * cos +
      // roll(x, D / 2) * sin, with sin's first half negated by the caller (rotate_half's sign).
      const T* kn = knew + b * ns[0] + h * ns[1];
      const T* vn = vnew + b * ms[0] + h * ms[1];
      const float* cb = cos + b * D;
      const float* sb = sin + b * D;
      float rotated[D];
      rotate<T, D>(kn, cb, sb, 1.f, rotated);
      T* kcol = kb + column / BLOCK * SPAN + column % BLOCK;
      for (int64_t d = 0; d < D; ++d) store(kcol, d * BLOCK, rotated[d]);
      std::memcpy(vb + column * vs[2], vn, D * sizeof(T));
      // Attended columns lie in [first, last), read in whole blocks from the one holding first
      // (masked columns score their bias, -inf, whatever the block holds there). The next
      // task's lines go towards L2 while this one computes, its blocks and attended values
      // only, a few from each inner iteration: issued all at once they stalled this task's own
      // loads, and reading took turns with computing instead of overlapping it.
      int64_t first, last;
      attended(b, first, last);
      ahead.flush();  // what the last task left
      if (task + 1 < end) {
        const int64_t nb = (task + 1) / KV, nh = (task + 1) % KV;
        int64_t lo, hi;
        attended(nb, lo, hi);
        const int64_t blocks = hi > lo ? (hi - 1) / BLOCK - lo / BLOCK + 1 : 0;
        ahead.next(reinterpret_cast<const char*>(kt + nb * ks[0] + nh * ks[1] + lo / BLOCK * SPAN),
                   blocks * SPAN * sizeof(T),
                   reinterpret_cast<const char*>(v + nb * vs[0] + nh * vs[1]) + lo * vs[2] * sizeof(T),
                   (hi - lo) * vs[2] * sizeof(T));
      }
      const float* mask = bias + b * bias_row;
      for (int64_t g = 0; g < G; ++g)
        rotate<T, D>(q + b * qs[0] + (h * G + g) * qs[1], cb, sb, scale, qf.data() + g * D);
      const int64_t c_first = first / BLOCK * BLOCK;  // the first block's first column
      for (int64_t g0 = 0; g0 < G; g0 += GB) {
        const float* qq = qf.data() + g0 * D;
        float* sg = scores.data() + g0 * C;
        // Two blocks at a time, then one (AVX2: a vector at a time). Within a block, a dim's
        // BLOCK columns are contiguous.
        int64_t c0 = c_first;
        if constexpr (key_pairs) {
          // each block's columns read as pairs: the even columns' scores and the odd ones' in
          // their own accumulators, put back in order once per block
          for (; c0 + BLOCK < last; c0 += 2 * BLOCK) {
            vfloat acc[GB][4] = {};
            const T* k0 = kb + c0 / BLOCK * SPAN;
            for (int64_t d = 0; d < D; ++d) {
              ahead.key();
              vfloat keys[4];
              load_pairs(k0 + d * BLOCK, keys[0], keys[1]);
              load_pairs(k0 + SPAN + d * BLOCK, keys[2], keys[3]);
              for (int64_t k = 0; k < 4; ++k)
                for (int64_t g = 0; g < GB; ++g) acc[g][k] += qq[g * D + d] * keys[k];
            }
            for (int64_t half = 0; half < 2; ++half)
              for (int64_t g = 0; g < GB; ++g)
                store_scores(acc[g][2 * half], acc[g][2 * half + 1], mask, c0 + half * BLOCK,
                             sg + g * C);
          }
          for (; c0 < last; c0 += BLOCK) {
            vfloat acc[GB][2] = {};
            const T* k0 = kb + c0 / BLOCK * SPAN;
            for (int64_t d = 0; d < D; ++d) {
              ahead.key();
              vfloat even, odd;
              load_pairs(k0 + d * BLOCK, even, odd);
              for (int64_t g = 0; g < GB; ++g) {
                acc[g][0] += qq[g * D + d] * even;
                acc[g][1] += qq[g * D + d] * odd;
              }
            }
            for (int64_t g = 0; g < GB; ++g) store_scores(acc[g][0], acc[g][1], mask, c0, sg + g * C);
          }
        } else {
          constexpr int64_t NB = 2 * BLOCK / LANES;  // vectors in two blocks
          // (AVX2: GB x NB accumulators would be 24 of its 16 registers; NV vectors, below)
          for (; WIDE && c0 + BLOCK < last; c0 += 2 * BLOCK) {
            vfloat acc[GB][NB] = {};
            const T* k0 = kb + c0 / BLOCK * SPAN;
            for (int64_t d = 0; d < D; ++d) {
              ahead.key();
              for (int64_t k = 0; k < NB; ++k) {
                const vfloat keys = loadv(k0 + k / 2 * SPAN + d * BLOCK + k % 2 * LANES);
                for (int64_t g = 0; g < GB; ++g) acc[g][k] += qq[g * D + d] * keys;
              }
            }
            store_masked(acc, mask, c0, sg, C);
          }
          // NV vectors at a time (AVX-512: one, the tail after two blocks at a time; AVX2: two or
          // four of a block, GB x NV independent chains of multiply-adds: with one vector its GB
          // chains waited out the multiply-add's latency, fp32 attention 5% and bf16 9% slower
          // on an AVX2 EPYC)
          for (; c0 < last; c0 += NV * LANES) {
            vfloat acc[GB][NV] = {};
            const T* k0 = kb + c0 / BLOCK * SPAN + c0 % BLOCK;
            for (int64_t d = 0; d < D; ++d) {
              ahead.key();
              for (int64_t k = 0; k < NV; ++k) {
                const vfloat keys = loadv(k0 + d * BLOCK + k * LANES);
                for (int64_t g = 0; g < GB; ++g) acc[g][k] += qq[g * D + d] * keys;
              }
            }
            store_masked(acc, mask, c0, sg, C);
          }
        }
        float inv[GB];
        for (int64_t g = 0; g < GB; ++g) {
          float* row = sg + g * C;
          // the peak by vectors: a scalar loop was one chain of dependent compares per head
          vfloat lanes = vfloat{} - INFINITY;
          int64_t c = first;
          for (; c + LANES <= last; c += LANES) {
            const vfloat x = loadv(row + c);
            lanes = x > lanes ? x : lanes;
          }
          float peak = -INFINITY;
          for (int64_t l = 0; l < LANES; ++l) peak = std::max(peak, lanes[l]);
          for (; c < last; ++c) peak = std::max(peak, row[c]);
          float total = 0.f;
#pragma omp simd reduction(+ : total)
          for (int64_t c = first; c < last; ++c) {
            row[c] = exp_nonpositive(row[c] - peak);
            total += row[c];
          }
          inv[g] = total > 0.f ? 1.f / total : 0.f;
        }
        // bfloat16 values are read as pairs on AVX-512 (load_pairs): acc[g][2i] sums the even dims of the
        // i-th 32 and acc[g][2i + 1] the odd ones, put back in order at the end.
        constexpr bool pairs = key_pairs && DV % 2 == 0;
        // The head dim in parts of DP vectors, a pass over the columns each (a task's values stay
        // in L1 between passes): all of it at once on AVX-512; on AVX2 at most twelve registers
        // of accumulators for the GB heads.
        constexpr int64_t FIT = 12 / GB;
        constexpr int64_t DP = WIDE ? DV
                               : FIT >= 4 && DV % 4 == 0 ? 4
                               : FIT >= 2 && DV % 2 == 0 ? 2
                                                         : 1;
        for (int64_t p0 = 0; p0 < DV; p0 += DP) {
          vfloat acc[GB][DP] = {};
          for (int64_t c = first; c < last; ++c) {
            if (p0 == 0) ahead.value();
            // a masked column (weight 0 for the whole group) is not read: whatever its value
            // holds, even nan, stays out of the sum
            bool attended = false;
            for (int64_t g = 0; g < GB; ++g) attended |= sg[g * C + c] != 0.f;
            if (!attended) continue;
            const T* vr = vb + c * vs[2] + p0 * LANES;
            if constexpr (pairs) {
              for (int64_t i = 0; i < DP; i += 2) {
                vfloat even, odd;
                load_pairs(vr + i * LANES, even, odd);
                for (int64_t g = 0; g < GB; ++g) {
                  acc[g][i] += sg[g * C + c] * even;
                  acc[g][i + 1] += sg[g * C + c] * odd;
                }
              }
            } else {
              for (int64_t i = 0; i < DP; ++i) {
                const vfloat values = loadv(vr + i * LANES);
                for (int64_t g = 0; g < GB; ++g) acc[g][i] += sg[g * C + c] * values;
              }
            }
          }
          for (int64_t g = 0; g < GB; ++g) {
            if constexpr (pairs)
              for (int64_t i = 0; i < DP; i += 2) interleave(acc[g][i], acc[g][i + 1], acc[g][i], acc[g][i + 1]);
            T* o = out + (b * H + h * G + g0 + g) * D + p0 * LANES;
            for (int64_t i = 0; i < DP; ++i)
              for (int64_t l = 0; l < LANES; ++l) store(o, i * LANES + l, acc[g][i][l] * inv[g]);
          }
        }
      }
    }
  });
}

// q [B, H, D] and k_new [B, KV, D] before their rotary embedding, v_new [B, KV, D] (this step's
// key and value are written at ``column`` of the cache first); cos, sin [B, D] float32 (sin's
// first half negated); key_blocks [B, KV, C / 32, D, 32] (blocks of 32 columns, each block's
// last two dims contiguous) and values [B, KV, C, D], the cache (views into the engine's
// buffers); bias [B, C] float32, 0 where a row attends, -inf elsewhere -> [B, H, D].
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                            const at::Tensor& cos, const at::Tensor& sin, at::Tensor key_blocks,
                            at::Tensor values, const at::Tensor& bias, int64_t column,
                            double scale) {
  TORCH_CHECK(q.dim() == 3 && k_new.dim() == 3 && v_new.dim() == 3 && key_blocks.dim() == 5 &&
                  values.dim() == 4 && bias.dim() == 2,
              "q [B, H, D], k_new and v_new [B, KV, D], key_blocks [B, KV, C / 32, D, 32], values "
              "[B, KV, C, D], bias [B, C]");
  for (const at::Tensor* t :
       std::initializer_list<const at::Tensor*>{&q, &k_new, &v_new, &key_blocks, &values, &bias})
    TORCH_CHECK(t->device().is_cpu() && t->stride(-1) == 1, "CPU tensors, last dim contiguous");
  TORCH_CHECK(key_blocks.size(4) == BLOCK && key_blocks.stride(3) == BLOCK &&
                  key_blocks.stride(2) == key_blocks.size(3) * BLOCK,
              "key_blocks: blocks of 32 columns, each [D, 32] contiguous, one after another");
  TORCH_CHECK(q.scalar_type() == key_blocks.scalar_type() && q.scalar_type() == values.scalar_type() &&
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
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KV = key_blocks.size(1),
                C = key_blocks.size(2) * BLOCK;
  TORCH_CHECK(KV > 0 && H % KV == 0 && key_blocks.size(0) == B && key_blocks.size(3) == D &&
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
  const int64_t ks[2] = {key_blocks.stride(0), key_blocks.stride(1)};
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
                         data<float>(sin), data<T>(key_blocks), data<T>(values), data<float>(bias),
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

// Sampling from a decode step's logits [B, V] (bf16 or fp32) in one pass per row that stays in
// cache, what generation_engine._sample and draw do with torch in five (the tempered softmax in
// fp32, block sums, their float64 cumulative sum, a block's cumulative sum, the gather): the row
// scaled by 1 / T in fp32, its max, each block's sum of exp(x - max) in fp32, the blocks'
// running sum in float64, the block that u * total falls in, then the token inside it from its
// own float64 running sum. Every token keeps its probability (draw's two levels, same blocks);
// the logprob is the tempered distribution's, in float64. T <= 0: the first maximum, with the
// logprob at T = 1 (as _sample reports greedy rows).
template <typename T>
void sample_rows(const T* logits, int64_t row, int64_t B, int64_t V, const float* temperature,
                 const double* u, int64_t chunk, int64_t* tokens, float* logprobs) {
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    const int64_t padded = (V + LANES - 1) / LANES * LANES;
    std::vector<float> x(padded, -INFINITY);  // lanes past V: exp gives 0, max ignores them
    std::vector<double> sums((V + chunk - 1) / chunk);
    const int64_t whole = V / LANES * LANES;
    for (int64_t b = begin; b < end; ++b) {
      const T* l = logits + b * row;
      const float t = temperature[b];
      const bool greedy = !(t > 0.f);
      // the tempered logit as torch computes it (a division in fp32); greedy rows at T = 1
      const float divisor = greedy ? 1.f : t;
      vfloat top = vfloat{} - INFINITY;
      for (int64_t i = 0; i < whole; i += LANES) {
        vfloat v = loadv(l + i);
        if (divisor != 1.f) v = v / divisor;
        std::memcpy(x.data() + i, &v, sizeof v);
        top = v > top ? v : top;
      }
      for (int64_t i = whole; i < V; ++i) x[i] = load(l, i) / divisor;
      float peak = -INFINITY;
      for (int64_t i = 0; i < LANES; ++i) peak = std::max(peak, top[i]);
      for (int64_t i = whole; i < V; ++i) peak = std::max(peak, x[i]);
      int64_t first_max = 0;
      if (greedy)
        while (first_max < V - 1 && !(x[first_max] == peak)) ++first_max;
      // chunk is a multiple of LANES (checked by the caller): blocks are whole vectors
      double total = 0.0;
      for (int64_t c0 = 0, k = 0; c0 < V; c0 += chunk, ++k) {
        const int64_t c1 = std::min(padded, c0 + chunk);
        vfloat acc = {};
        for (int64_t i = c0; i < c1; i += LANES) acc += exp_nonpositive(loadv(x.data() + i) - peak);
        float block = 0.f;
        for (int64_t i = 0; i < LANES; ++i) block += acc[i];
        sums[k] = block;
        total += block;
      }
      int64_t token = first_max;
      if (!greedy) {
        const double target = u[b] * total;
        double before = 0.0;
        int64_t k = 0;
        const int64_t blocks = static_cast<int64_t>(sums.size());
        while (k < blocks - 1 && before + sums[k] <= target) before += sums[k++];
        const double rest = std::min(std::max((target - before) / sums[k], 0.0), 1.0 - 0x1p-40);
        const int64_t c0 = k * chunk, c1 = std::min(V, c0 + chunk);
        double within = 0.0;
        for (int64_t i = c0; i < c1; ++i) within += exp_nonpositive(x[i] - peak);
        const double goal = rest * within;
        double run = 0.0;
        token = c1 - 1;
        for (int64_t i = c0; i < c1; ++i) {
          run += exp_nonpositive(x[i] - peak);
          if (run > goal) {
            token = i;
            break;
          }
        }
      }
      // the reported logprob: at T for a sampled row, at 1 for a greedy one (x is then l)
      logprobs[b] = static_cast<float>(double(x[token] - peak) - std::log(total));
      tokens[b] = token;
    }
  });
}

// logits [B, V] (bf16 or fp32, rows contiguous), temperature [B] float32 (<= 0: greedy),
// u [B] float64 in [0, 1) -> (tokens [B] int64, logprobs [B] float32).
std::tuple<at::Tensor, at::Tensor> sample(const at::Tensor& logits, const at::Tensor& temperature,
                                          const at::Tensor& u, int64_t chunk) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu() && logits.stride(1) == 1,
              "logits: [B, V] on CPU, rows contiguous");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "logits: float32 or bfloat16");
  const int64_t B = logits.size(0), V = logits.size(1);
  static_assert(SAMPLE_MULTIPLE % LANES == 0, "a block is whole vectors");
  TORCH_CHECK(V > 0 && chunk > 0 && chunk % SAMPLE_MULTIPLE == 0, "an empty vocabulary, or a block that "
              "is not a multiple of 16");
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.is_contiguous() &&
                  temperature.numel() == B,
              "temperature: [B] float32");
  TORCH_CHECK(u.scalar_type() == at::kDouble && u.is_contiguous() && u.numel() == B,
              "u: [B] float64");
  auto tokens = at::empty({B}, logits.options().dtype(at::kLong));
  auto logprobs = at::empty({B}, logits.options().dtype(at::kFloat));
  auto typed = [&](auto element) {
    using T = decltype(element);
    sample_rows<T>(data<T>(logits), logits.stride(0), B, V, data<float>(temperature),
                   data<double>(u), chunk, data<int64_t>(tokens), data<float>(logprobs));
  };
  if (logits.scalar_type() == at::kFloat)
    typed(float{});
  else
    typed(uint16_t{});
  return {tokens, logprobs};
}

}  // namespace

TORCH_LIBRARY(oolong, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor cos, Tensor sin, "
      "Tensor(a!) key_blocks, Tensor(b!) values, Tensor bias, int column, float scale) -> Tensor");
  m.def("rms_norm(Tensor hidden, Tensor weight, float eps) -> Tensor");
  m.def("sample(Tensor logits, Tensor temperature, Tensor u, int chunk) -> (Tensor, Tensor)");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("sample", c10::DispatchKey::CPU, &sample);
  m.impl("decode_attention", c10::DispatchKey::CPU, &decode_attention);
}
