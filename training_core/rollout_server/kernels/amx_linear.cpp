// The engine's bf16 linear layers on Intel AMX: out[M, N] = x[M, K] . W[N, K]^T with the decode
// step's epilogues fused (a residual add; SiLU(gate) * up). See training_core/rollout_server/fused_decode.py
// for why; built with the other kernels (cpu_kernels.py), and only where the compiler targets AMX.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "projection_epilogue.h"

#include <cstdint>
#include <cstring>
#include <mutex>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define OOLONG_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using namespace oolong_projection;

// A packed block: 32 output columns (two tiles of 16) by 32 of K, as AMX's B operand wants it
// (pairs of K interleaved: [tile][k / 2][column][k % 2]), 2 KB. A weight is [N / 32][K / 32]
// such blocks: each 32 columns' panel is one contiguous stream, read once per call.
constexpr int64_t COLS = 32, DEPTH = 32, BLOCK = COLS * DEPTH;
constexpr int64_t ROWS = 32;  // rows of x per pass over a panel (two tiles of 16)

#ifdef OOLONG_AMX

bool permitted() {  // Linux hands out AMX's tile state only on request (once per process)
  static std::once_flag once;
  static bool ok = false;
  constexpr int kReqXcompPerm = 0x1023, kXtiledata = 18;
  std::call_once(once, [] { ok = syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0; });
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// One thread's share of the output's column panels [first, last): for each panel, x in passes of
// 32 rows (C: 2 x 2 tiles of 16 x 16 floats, A: two tiles of x, B: the panel's two tiles).
void panels(const uint16_t* x, const uint16_t* w, uint16_t* out, const uint16_t* other,
            Epilogue epi, int64_t M, int64_t K, int64_t ld_out, int64_t first, int64_t last) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  const int64_t steps = K / DEPTH;
  alignas(64) float c[ROWS * COLS];
  for (int64_t p = first; p < last; ++p) {
    const uint16_t* panel = w + p * steps * BLOCK;
    for (int64_t m0 = 0; m0 < M; m0 += ROWS) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const uint16_t* a = x + m0 * K;
      for (int64_t s = 0; s < steps; ++s) {
        const uint16_t* b = panel + s * BLOCK;
        if (m0 == 0) {  // the stream ahead into L2 while the tiles compute: 17.3 against
          // 15.6 GB/s over a SmolLM2 step's projections (the next pass finds it in cache)
          const char* ahead = reinterpret_cast<const char*>(b) + 4096;
          for (int i = 0; i < BLOCK * 2; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T2);
        }
        // Each load just before its first use: tiles are not renamed, so a load waits for the
        // products still reading its tile, and the products wait for their loads; loading all
        // four first left the tile unit idle for the last one (3-5% over a step's projections).
        _tile_loadd(4, a + s * DEPTH, K * 2);
        _tile_loadd(6, b, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, b + BLOCK / 2, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, a + 16 * K + s * DEPTH, K * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c, COLS * 4);
      _tile_stored(1, c + 16, COLS * 4);
      _tile_stored(2, c + 16 * COLS, COLS * 4);
      _tile_stored(3, c + 16 * COLS + 16, COLS * 4);
      const int64_t rows = std::min(ROWS, M - m0);
      for (int64_t r = 0; r < rows; ++r)
        write_row(_mm512_load_ps(c + r * COLS), _mm512_load_ps(c + r * COLS + 16), epi, m0 + r, p,
                  out, other, ld_out);
    }
  }
  _tile_release();
}

#endif  // OOLONG_AMX

bool amx_available() {
#ifdef OOLONG_AMX
  return permitted();
#else
  return false;
#endif
}

// w [N, K] bf16 (N and K multiples of 32) -> the packed blocks [N / 32, K / 32, 1024].
at::Tensor amx_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu(),
              "w: [N, K] bfloat16 on CPU");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % COLS == 0 && K % DEPTH == 0, "N and K must be multiples of 32, got ", N, " x ",
              K);
  const at::Tensor src = w.contiguous();
  auto out = at::empty({N / COLS, K / DEPTH, BLOCK}, w.options());
  const auto* s = reinterpret_cast<const uint16_t*>(src.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t steps = K / DEPTH;
  at::parallel_for(0, N / COLS, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t st = 0; st < steps; ++st) {
        uint16_t* blk = o + (p * steps + st) * BLOCK;
        for (int64_t t = 0; t < 2; ++t)
          for (int64_t k2 = 0; k2 < DEPTH / 2; ++k2)
            for (int64_t c = 0; c < 16; ++c)
              for (int64_t e = 0; e < 2; ++e)
                blk[((t * 16 + k2) * 16 + c) * 2 + e] =
                    s[(p * COLS + t * 16 + c) * K + st * DEPTH + 2 * k2 + e];
      }
  });
  return out;
}

// x [M, K] bf16 . the packed weight -> [M, N] bf16; epilogue "none", "add" (other [M, N], added
// before the rounding) or "silu_mul" (each panel's first 16 columns a gate, its last 16 the up
// projection: [M, N / 2] = bf16(bf16(SiLU(gate)) * up)).
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed,
                      const c10::optional<at::Tensor>& other, c10::string_view epilogue) {
  TORCH_CHECK(amx_available(), "AMX is not available to this process");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == BLOCK && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous(),
              "packed: amx_pack's [N / 32, K / 32, 1024]");
  int64_t width = 0;
  const int64_t N = packed.size(0) * COLS;
  const Epilogue epi = checked_epilogue(x, N, other, epilogue, width);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.size(1) * DEPTH == K, "x has ", K, " columns, the weight ", packed.size(1) * DEPTH);
  // x in passes of 32 rows: a ragged batch is padded with zero rows (x is small)
  const int64_t padded = (M + ROWS - 1) / ROWS * ROWS;
  at::Tensor a = x;
  if (padded != M || !x.is_contiguous()) {
    a = at::zeros({padded, K}, x.options());
    a.narrow(0, 0, M).copy_(x);
  }
  auto out = at::empty({M, width}, x.options());
#ifdef OOLONG_AMX
  const auto* xa = reinterpret_cast<const uint16_t*>(a.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const auto* ot = other ? reinterpret_cast<const uint16_t*>(other->data_ptr()) : nullptr;
  at::parallel_for(0, N / COLS, 1, [&](int64_t begin, int64_t end) {
    panels(xa, wp, op, ot, epi, M, K, width, begin, end);
  });
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(oolong, m) {
  m.def("amx_available() -> bool", &amx_available);  // no tensors: a catch-all kernel
  m.def("amx_pack(Tensor w) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? other, str epilogue) -> Tensor");
  m.impl("amx_pack", c10::DispatchKey::CPU, &amx_pack);
  m.impl("amx_linear", c10::DispatchKey::CPU, &amx_linear);
}
