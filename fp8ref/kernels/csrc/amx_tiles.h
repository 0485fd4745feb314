// AMX tile operations, two ways: the real instructions (RealTiles), and a software emulation of
// their documented semantics (EmuTiles) that runs on any CPU. gemm_amx.cpp writes its tile logic
// once, as a template over these two, so that every tile configuration, load, dot product and store
// of the real kernel also runs, checked, under the emulation (tests/test_amx.py).
//
// What the emulation models (Intel SDM, TDPBF16PS, LDTILECFG, TILELOADD, TILESTORED):
// - LDTILECFG: palette 1, 8 tiles of at most 16 rows x 64 bytes; a configuration that the
//   instruction would fault on (#GP) raises here instead, and so does any tile op that would
//   raise #UD (an unconfigured tile, mismatched shapes, one tile used twice in one instruction).
//   Loading a configuration zeroes every tile.
// - TILELOADD / TILESTORED: rows x colsb bytes at base + row * stride; the rest of a loaded tile
//   reads as zero.
// - TDPBF16PS C += A . B, per row m of C: two fp32 temporaries per output column n, both starting
//   at 0, take the even and the odd products of the K pairs in order, each an fp32 FMA (round to
//   nearest even; input denormals read as zero (DAZ), denormal results flushed to zero (FTZ));
//   then C[m][n] = (C[m][n] + (even + odd)), two more such roundings. MXCSR plays no part.
//   FTZ is applied to the rounded result (tininess after rounding); cpu-fp8-amx's operands never
//   come near it (see gemm_amx.cpp). A zero's sign follows IEEE addition (-0 + +0 = +0).
#pragma once

#include <c10/util/Exception.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace fp8ref {
namespace amx {

constexpr int kMaxRows = 16, kMaxColsb = 64, kTiles = 8;

// The 64-byte operand of LDTILECFG.
struct alignas(64) TileConfig {
  uint8_t palette_id = 0;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG takes 64 bytes");

inline bool same_config(const TileConfig& a, const TileConfig& b) { return std::memcmp(&a, &b, 64) == 0; }

// The real instructions. Inline assembly with "memory" clobbers (GCC's own _tile_loadd tells the
// compiler nothing about the memory it reads, so stores into a buffer could be moved past the load
// that reads it); tile numbers are immediates (%c). Each runs only after amx_status() said yes.
struct RealTiles {
  __attribute__((target("amx-tile"))) static void configure(const TileConfig& c) {
    asm volatile("ldtilecfg %0" ::"m"(c) : "memory");
  }
  __attribute__((target("amx-tile"))) static void release() { asm volatile("tilerelease" ::: "memory"); }
  template <int T>
  __attribute__((target("amx-tile"))) static void zero() {
    asm volatile("tilezero %%tmm%c0" ::"i"(T));
  }
  template <int T>
  __attribute__((target("amx-tile"))) static void load(const void* base, int64_t stride) {
    asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "i"(T) : "memory");
  }
  template <int T>
  __attribute__((target("amx-tile"))) static void store(void* base, int64_t stride) {
    asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(stride), "i"(T) : "memory");
  }
  // C += A . B (Intel operand order: tdpbf16ps tmm_C, tmm_A, tmm_B)
  template <int C, int A, int B>
  __attribute__((target("amx-tile,amx-bf16"))) static void dpbf16ps() {
    asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  }
};

// Input denormals read as zero, of the same sign.
inline float daz(float x) { return std::fabs(x) < FLT_MIN ? std::copysign(0.0f, x) : x; }
// A denormal result becomes zero, of the same sign.
inline float ftz(float x) { return daz(x); }

// fl(x * y + t) with one rounding, then FTZ, for bf16 values x, y and a non-denormal t. A product
// of two bf16 values has at most 16 significant bits, so it is exact in fp32 unless it leaves the
// normal range: then one addition is the FMA; otherwise fmaf.
inline float fma_ftz(float x, float y, float t) {
  const float p = x * y;
  const float ap = std::fabs(p);
  if ((ap >= FLT_MIN && ap <= FLT_MAX) || x == 0.0f || y == 0.0f) return ftz(t + p);
  return ftz(std::fma(x, y, t));
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The emulation: per-thread tile state, like the real registers.
struct EmuTiles {
  struct State {
    TileConfig cfg;
    bool configured = false;
    alignas(64) uint8_t t[kTiles][kMaxRows][kMaxColsb];
  };
  static State& st() {
    thread_local State s;
    return s;
  }
  static void check_config(const TileConfig& c) {
    TORCH_CHECK(c.palette_id == 1, "AMX emulation: LDTILECFG would fault: palette ", (int)c.palette_id, " is not 1");
    TORCH_CHECK(c.start_row == 0, "AMX emulation: LDTILECFG would fault: start_row ", (int)c.start_row);
    for (uint8_t r : c.reserved) TORCH_CHECK(r == 0, "AMX emulation: LDTILECFG would fault: reserved bytes set");
    for (int i = 0; i < 16; ++i) {
      if (i >= kTiles) {
        TORCH_CHECK(c.rows[i] == 0 && c.colsb[i] == 0, "AMX emulation: tile ", i, " does not exist in palette 1");
        continue;
      }
      TORCH_CHECK(c.rows[i] <= kMaxRows && c.colsb[i] <= kMaxColsb, "AMX emulation: LDTILECFG would fault: tile ", i,
                  " is ", (int)c.rows[i], " x ", c.colsb[i], " bytes (at most 16 x 64)");
      TORCH_CHECK((c.rows[i] == 0) == (c.colsb[i] == 0) && c.colsb[i] % 4 == 0, "AMX emulation: tile ", i,
                  " has rows ", (int)c.rows[i], " and colsb ", c.colsb[i], " (both 0, or colsb a multiple of 4)");
    }
  }
  static void configure(const TileConfig& c) {
    check_config(c);
    State& s = st();
    s.cfg = c;
    s.configured = true;
    std::memset(s.t, 0, sizeof(s.t));
  }
  static void release() {
    State& s = st();
    s.configured = false;
    s.cfg = TileConfig{};
    std::memset(s.t, 0, sizeof(s.t));
  }
  static void check_tile(int t) {
    const State& s = st();
    TORCH_CHECK(s.configured && s.cfg.rows[t] > 0, "AMX emulation: tile ", t, " is used but not configured (#UD)");
  }
  template <int T>
  static void zero() {
    check_tile(T);
    std::memset(st().t[T], 0, sizeof(st().t[T]));
  }
  template <int T>
  static void load(const void* base, int64_t stride) {
    check_tile(T);
    State& s = st();
    std::memset(s.t[T], 0, sizeof(s.t[T]));
    for (int r = 0; r < s.cfg.rows[T]; ++r) std::memcpy(s.t[T][r], (const uint8_t*)base + r * stride, s.cfg.colsb[T]);
  }
  template <int T>
  static void store(void* base, int64_t stride) {
    check_tile(T);
    const State& s = st();
    for (int r = 0; r < s.cfg.rows[T]; ++r) std::memcpy((uint8_t*)base + r * stride, s.t[T][r], s.cfg.colsb[T]);
  }
  template <int C, int A, int B>
  static void dpbf16ps() {
    static_assert(C != A && C != B && A != B, "TDPBF16PS needs three different tiles (#UD)");
    check_tile(C);
    check_tile(A);
    check_tile(B);
    State& s = st();
    const TileConfig& c = s.cfg;
    TORCH_CHECK(c.colsb[C] == c.colsb[B] && c.rows[C] == c.rows[A] && c.colsb[A] / 4 == c.rows[B],
                "AMX emulation: TDPBF16PS shapes would fault (#UD): C ", (int)c.rows[C], "x", c.colsb[C], ", A ",
                (int)c.rows[A], "x", c.colsb[A], ", B ", (int)c.rows[B], "x", c.colsb[B]);
    const int nk = c.colsb[A] / 4, nn = c.colsb[C] / 4;
    float bf[kMaxRows][kMaxColsb / 2];  // B as fp32, DAZ applied once
    for (int k = 0; k < nk; ++k)
      for (int i = 0; i < 2 * nn; ++i) bf[k][i] = daz(bf16_to_float(((const uint16_t*)s.t[B][k])[i]));
    for (int m = 0; m < c.rows[C]; ++m) {
      float tmp[kMaxColsb / 2] = {};  // [2 n + h]: the even (h = 0) and odd (h = 1) sums of column n
      const uint16_t* a = (const uint16_t*)s.t[A][m];
      for (int k = 0; k < nk; ++k) {
        const float a0 = daz(bf16_to_float(a[2 * k])), a1 = daz(bf16_to_float(a[2 * k + 1]));
        for (int n = 0; n < nn; ++n) {
          tmp[2 * n] = fma_ftz(a0, bf[k][2 * n], tmp[2 * n]);
          tmp[2 * n + 1] = fma_ftz(a1, bf[k][2 * n + 1], tmp[2 * n + 1]);
        }
      }
      float* crow = (float*)s.t[C][m];
      for (int n = 0; n < nn; ++n) {
        const float pair = ftz(daz(tmp[2 * n]) + daz(tmp[2 * n + 1]));
        crow[n] = ftz(daz(crow[n]) + pair);
      }
      std::memset(s.t[C][m] + c.colsb[C], 0, kMaxColsb - c.colsb[C]);  // write_row_and_zero
    }
    for (int m = c.rows[C]; m < kMaxRows; ++m) std::memset(s.t[C][m], 0, kMaxColsb);  // zero_upper_rows
  }
};

}  // namespace amx
}  // namespace fp8ref
