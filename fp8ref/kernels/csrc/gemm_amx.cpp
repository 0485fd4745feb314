// The cpu-fp8-amx GEMM: E4M3FN codes decoded to their exact bf16 bits straight into AMX tiles,
// products accumulated by TDPBF16PS in fp32 tiles. The tile logic is one template over the tile
// operations (amx_tiles.h): RealTiles on CPUs with AMX (after amx_status() said yes), EmuTiles
// anywhere (tests/test_amx.py), so every configuration, tail and chunk of the real kernel also
// runs, checked, on machines without AMX.
//
// Layout. The weight is cpu-fp8's packed [N16][K2][16][2] codes (pack_weight): for one block of 16
// output columns, the 32 bytes at pair index p are one row of a TDPBF16PS B tile (16 columns x
// one bf16 pair: the "VNNI" layout), so a B tile of 16 pairs is 512 consecutive code bytes, decoded
// into 1 KiB of bf16. The activations are decoded once per call into a bf16 [M, lda] buffer whose
// rows are A-tile rows (16 pairs = 64 bytes per tile row), lda padded by 64 bytes so that the 16
// rows of a tile do not share one L1 set.
//
// Blocking. Work items are groups of two column blocks (32 columns; the last may have one). Per
// item, K goes in chunks of kChunkPairs pairs: the chunk's B panel is decoded once (2 x 16 KiB),
// then every row chunk of up to 32 rows (two A tiles) runs its 2 x 2 C tiles over it: per 16 pairs,
// two A-tile loads, two B-tile loads, four TDPBF16PS. With more than 32 rows, C tiles are stored to
// an fp32 buffer between K chunks and loaded back (exact); with at most 32 they stay in the tiles.
// Tails: a row chunk of r < 16 rows configures its A and C tiles with r rows; N is padded to 16 by
// the packing (zero codes) and the epilogue writes only n < N; K is padded to a multiple of 16 pairs
// in the decoded buffers (zero bf16: exact zero products).
//
// Numerics (strict class: Accumulation.FP32, one output rounding). Every E4M3FN value is exactly a
// bf16 (at most 4 significant bits, exponents -9..8) and a normal one (|v| >= 2^-9 > 2^-126), so
// TDPBF16PS's DAZ never acts on an input. A product of two is exact in fp32 (at most 8 significant
// bits), and every temporary, pair sum and C value is an integer multiple of 2^-18 (the smallest
// product), so a non-zero one is at least 2^-18 > 2^-126 and FTZ never acts either; |sums| <=
// K * 448^2 stays finite. Each addition of the instruction rounds once (round to nearest even), so
// each output is a sum of its K exact products by a tree of additions each rounded once, which is
// what the fp32 accumulation bound (gamma_{K-1}) covers in any order. The epilogue
// (acc * sa[m]) * sb[n] (+ bias[n]) is fp32 and torch rounds the result once to the output dtype.
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "amx_tiles.h"
#include "decode.h"
#include "fp8ref_cpu.h"

namespace fp8ref {
namespace {

using amx::TileConfig;

// K pairs per decoded B panel chunk: 2 column blocks x 256 pairs x 64 bytes = 32 KiB.
constexpr int64_t kChunkPairs = 256;
// Rows per row chunk (two A tiles), and columns per work item (two column blocks): the fp32 buffer
// of C is [rows][kGroupCols].
constexpr int64_t kRowChunk = 32, kGroupCols = 32;

// Tile numbers: C[i][j] = 2 i + j for A tile i and B tile j; A tiles 4, 5; B tiles 6, 7.
TileConfig make_config(int r0, int r1, int nt) {
  TileConfig c;
  c.palette_id = 1;
  const int rows[2] = {r0, r1};
  for (int i = 0; i < 2; ++i) {
    if (rows[i] == 0) continue;
    c.rows[4 + i] = (uint8_t)rows[i];
    c.colsb[4 + i] = 64;
    for (int j = 0; j < nt; ++j) {
      c.rows[2 * i + j] = (uint8_t)rows[i];
      c.colsb[2 * i + j] = 64;
    }
  }
  for (int j = 0; j < nt; ++j) {
    c.rows[6 + j] = 16;
    c.colsb[6 + j] = 64;
  }
  return c;
}

// Pairs [p0, p1) of one column block's packed codes (32 bytes per pair) -> bf16 B-tile rows (64
// bytes per pair); pairs at or beyond K2 are the K padding: zeros.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void decode_panel_avx512(const uint8_t* pb, const uint8_t* sp,
                                                                                int64_t p0, int64_t p1, int64_t K2,
                                                                                uint16_t* dst) {
  for (int64_t p = p0; p < p1; ++p, dst += 32) {
    const __m512i v = p >= K2 ? _mm512_setzero_si512()
                              : (sp[p] ? decode32_bf16(pb + p * 32) : decode32_bf16_normal(pb + p * 32));
    _mm512_storeu_si512(dst, v);
  }
}

void decode_panel_scalar(const uint8_t* pb, const uint8_t*, int64_t p0, int64_t p1, int64_t K2, uint16_t* dst) {
  for (int64_t p = p0; p < p1; ++p, dst += 32)
    for (int i = 0; i < 32; ++i) dst[i] = p >= K2 ? 0 : bf16_of_code(pb[p * 32 + i]);
}

// One row chunk (MT A tiles) x NT column blocks over `steps` x 16 pairs. a: the chunk's first row
// at the K chunk's first pair; b: the decoded panel ([NT][kChunkPairs][32] bf16); c: the fp32
// buffer at the chunk's first row ([rows][kGroupCols]).
template <class T, int MT, int NT>
void tile_block(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t steps, float* c, bool load_c,
                bool keep) {
  constexpr int64_t ldc = kGroupCols * 4;  // bytes
  const int64_t lda_bytes = lda * 2;
  if (load_c) {
    T::template load<0>(c, ldc);
    if constexpr (NT > 1) T::template load<1>(c + 16, ldc);
    if constexpr (MT > 1) T::template load<2>(c + 16 * kGroupCols, ldc);
    if constexpr (MT > 1 && NT > 1) T::template load<3>(c + 16 * kGroupCols + 16, ldc);
  }
  for (int64_t s = 0; s < steps; ++s) {
    T::template load<4>(a + s * 32, lda_bytes);
    if constexpr (MT > 1) T::template load<5>(a + 16 * lda + s * 32, lda_bytes);
    T::template load<6>(b + s * 16 * 32, 64);
    if constexpr (NT > 1) T::template load<7>(b + (kChunkPairs + s * 16) * 32, 64);
    T::template dpbf16ps<0, 4, 6>();
    if constexpr (NT > 1) T::template dpbf16ps<1, 4, 7>();
    if constexpr (MT > 1) T::template dpbf16ps<2, 5, 6>();
    if constexpr (MT > 1 && NT > 1) T::template dpbf16ps<3, 5, 7>();
  }
  if (keep) return;
  T::template store<0>(c, ldc);
  if constexpr (NT > 1) T::template store<1>(c + 16, ldc);
  if constexpr (MT > 1) T::template store<2>(c + 16 * kGroupCols, ldc);
  if constexpr (MT > 1 && NT > 1) T::template store<3>(c + 16 * kGroupCols + 16, ldc);
}

template <class T>
void zero_c(int mt, int nt) {
  T::template zero<0>();
  if (nt > 1) T::template zero<1>();
  if (mt > 1) T::template zero<2>();
  if (mt > 1 && nt > 1) T::template zero<3>();
}

struct Problem {
  const uint16_t* abuf;  // [M][lda] bf16 bits, zero beyond K
  int64_t lda, M, N, N16, K2, K2p;
  const uint8_t* pb;  // [N16][K2][16][2] codes
  const uint8_t* sp;  // [N16][K2]
  const float *sa, *sb, *bias;
  float* out;
  bool vec_decode;
};

template <class T>
void run_groups(const Problem& P, int64_t g0, int64_t g1) {
  std::vector<uint16_t> panel(2 * kChunkPairs * 32);
  std::vector<float> cacc(((P.M + kRowChunk - 1) / kRowChunk) * kRowChunk * kGroupCols);
  const bool single = P.M <= kRowChunk;
  const auto decode = P.vec_decode ? decode_panel_avx512 : decode_panel_scalar;
  TileConfig current;
  bool configured = false;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t nb0 = 2 * g;
    const int nt = (int)std::min<int64_t>(2, P.N16 - nb0);
    for (int64_t kc = 0; kc < P.K2p; kc += kChunkPairs) {
      const int64_t kp = std::min(kChunkPairs, P.K2p - kc);  // a multiple of 16
      for (int j = 0; j < nt; ++j)
        decode(P.pb + (nb0 + j) * P.K2 * 32, P.sp + (nb0 + j) * P.K2, kc, kc + kp, P.K2,
               panel.data() + j * kChunkPairs * 32);
      const bool last = kc + kp >= P.K2p;
      for (int64_t mc = 0; mc < P.M; mc += kRowChunk) {
        const int r0 = (int)std::min<int64_t>(16, P.M - mc);
        const int r1 = (int)std::min<int64_t>(16, std::max<int64_t>(0, P.M - mc - 16));
        const TileConfig cfg = make_config(r0, r1, nt);
        if (!configured || !amx::same_config(cfg, current)) {
          T::configure(cfg);  // (zeroes every tile: only ever at a K chunk's start or with C in memory)
          current = cfg;
          configured = true;
        }
        const int mt = r1 > 0 ? 2 : 1;
        if (kc == 0) zero_c<T>(mt, nt);
        const bool load_c = kc > 0 && !single, keep = single && !last;
        const uint16_t* a = P.abuf + mc * P.lda + 2 * kc;
        float* c = cacc.data() + mc * kGroupCols;
        const int64_t steps = kp / 16;
        if (mt == 2 && nt == 2) tile_block<T, 2, 2>(a, P.lda, panel.data(), steps, c, load_c, keep);
        else if (mt == 2) tile_block<T, 2, 1>(a, P.lda, panel.data(), steps, c, load_c, keep);
        else if (nt == 2) tile_block<T, 1, 2>(a, P.lda, panel.data(), steps, c, load_c, keep);
        else tile_block<T, 1, 1>(a, P.lda, panel.data(), steps, c, load_c, keep);
      }
    }
    const int64_t n0 = nb0 * 16, n1 = std::min(P.N, (nb0 + nt) * 16);
    for (int64_t m = 0; m < P.M; ++m)
      for (int64_t n = n0; n < n1; ++n) {
        float y = cacc[m * kGroupCols + (n - n0)] * P.sa[m];
        y = y * P.sb[n];
        if (P.bias) y = y + P.bias[n];
        P.out[m * P.N + n] = y;
      }
  }
  if (configured) T::release();
}

}  // namespace

std::string amx_status() {
  static const std::string status = []() -> std::string {
    std::string missing;
    if (!__builtin_cpu_supports("amx-tile")) missing += " amx_tile";
    if (!__builtin_cpu_supports("amx-bf16")) missing += " amx_bf16";
    if (!__builtin_cpu_supports("avx512f")) missing += " avx512f";
    if (!__builtin_cpu_supports("avx512bw")) missing += " avx512bw";
    if (!__builtin_cpu_supports("avx512bf16")) missing += " avx512_bf16";
    if (!missing.empty()) return "this CPU lacks" + missing;
    // Linux hands out AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM = 0x1023,
    // XFEATURE_XTILEDATA = 18), process-wide; without it the first tile instruction faults.
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0)
      return std::string("the OS refused AMX tile data: arch_prctl(ARCH_REQ_XCOMP_PERM) failed: ") +
             std::strerror(errno);
    unsigned long perm = 0;
    if (syscall(SYS_arch_prctl, 0x1022, &perm) != 0 || !(perm & (1ul << 18)))
      return "the OS did not grant AMX tile data (ARCH_GET_XCOMP_PERM lacks bit 18)";
    return "";
  }();
  return status;
}

// a: [M, K] codes; pb, special: pack_weight's; out[m, n] = (acc * sa[m]) * sb[n] (+ bias[n]), fp32.
// emulate: the same tile logic on EmuTiles (any CPU).
at::Tensor fp8_e4m3_gemm_amx(at::Tensor a, at::Tensor pb, at::Tensor special, int64_t N, at::Tensor sa,
                             at::Tensor sb, at::Tensor bias, bool has_bias, bool emulate) {
  if (!emulate) {
    const std::string why = amx_status();
    TORCH_CHECK(why.empty(), "the cpu-fp8-amx kernel cannot run here: ", why);
  }
  check_cpu(a, "a");
  check_cpu(pb, "pb");
  check_cpu(special, "special");
  TORCH_CHECK(a.dtype() == at::kByte && pb.dtype() == at::kByte, "codes must be uint8 views");
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous() && pb.is_contiguous() && pb.dim() == 4,
              "contiguous a, packed [N16, K2, 16, 2] b");
  const int64_t M = a.size(0), K = a.size(1), N16 = pb.size(0), K2 = pb.size(1);
  TORCH_CHECK(N >= 0 && K2 == (K + 1) / 2 && N16 == (N + 15) / 16 && pb.size(2) == 16 && pb.size(3) == 2,
              "packed shape");
  TORCH_CHECK(special.dtype() == at::kByte && special.is_contiguous() && special.numel() == N16 * K2,
              "special must be uint8 [N16, K2]");
  check_epilogue_args(sa, sb, bias, has_bias, M, N);
  auto out = at::empty({M, N}, at::dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
  const int64_t K2p = (K2 + 15) / 16 * 16, lda = 2 * K2p + 32;
  std::vector<uint16_t> abuf(M * lda, 0);
  const uint8_t* ap = a.data_ptr<uint8_t>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) abuf[m * lda + k] = bf16_of_code(ap[m * K + k]);
  const Problem P{abuf.data(),
                  lda,
                  M,
                  N,
                  N16,
                  K2,
                  K2p,
                  pb.data_ptr<uint8_t>(),
                  special.data_ptr<uint8_t>(),
                  sa.data_ptr<float>(),
                  sb.data_ptr<float>(),
                  has_bias ? bias.data_ptr<float>() : nullptr,
                  out.data_ptr<float>(),
                  has_bf16_dot()};
  const int64_t groups = (N16 + 1) / 2;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    if (emulate) run_groups<amx::EmuTiles>(P, g0, g1);
    else run_groups<amx::RealTiles>(P, g0, g1);
  });
  return out;
}

// One TDPBF16PS on explicit tiles, emulated: C [m, n] fp32 += A [m, 2k] bf16 . B [k, 2n] bf16
// (B in the pair layout). For tests of the emulation's semantics and of its fault checks.
at::Tensor amx_emu_tdpbf16ps(at::Tensor c, at::Tensor a, at::Tensor b) {
  TORCH_CHECK(c.scalar_type() == at::kFloat && a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16,
              "c fp32, a and b bf16");
  TORCH_CHECK(c.dim() == 2 && a.dim() == 2 && b.dim() == 2, "2-D tiles");
  check_cpu(c, "c");
  check_cpu(a, "a");
  check_cpu(b, "b");
  auto cc = c.contiguous().clone();
  auto ac = a.contiguous();
  auto bc = b.contiguous();
  TileConfig cfg;
  cfg.palette_id = 1;
  cfg.rows[0] = (uint8_t)std::min<int64_t>(cc.size(0), 255);
  cfg.colsb[0] = (uint16_t)std::min<int64_t>(cc.size(1) * 4, 65535);
  cfg.rows[1] = (uint8_t)std::min<int64_t>(ac.size(0), 255);
  cfg.colsb[1] = (uint16_t)std::min<int64_t>(ac.size(1) * 2, 65535);
  cfg.rows[2] = (uint8_t)std::min<int64_t>(bc.size(0), 255);
  cfg.colsb[2] = (uint16_t)std::min<int64_t>(bc.size(1) * 2, 65535);
  amx::EmuTiles::configure(cfg);
  amx::EmuTiles::load<0>(cc.data_ptr(), cc.size(1) * 4);
  amx::EmuTiles::load<1>(ac.data_ptr(), ac.size(1) * 2);
  amx::EmuTiles::load<2>(bc.data_ptr(), bc.size(1) * 2);
  amx::EmuTiles::dpbf16ps<0, 1, 2>();
  amx::EmuTiles::store<0>(cc.data_ptr(), cc.size(1) * 4);
  amx::EmuTiles::release();
  return cc;
}

}  // namespace fp8ref
