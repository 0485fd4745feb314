// The cpu-fp8-amx GEMM: E4M3FN codes decoded to their exact bf16 bits straight into AMX tiles,
// products accumulated by TDPBF16PS in fp32 tiles. The tile logic is one template over the tile
// operations (amx_tiles.h): RealTiles on CPUs with AMX (after amx_status() said yes), EmuTiles
// anywhere (tests/test_amx.py), so every configuration, tail and chunk of the real kernel also
// runs, checked, on machines without AMX.
//
// Layout. The weight is cpu-fp8's packed [N16][K2][16][2] codes (pack_weight): for one block of 16
// output columns, the 32 bytes at pair index p are one row of a TDPBF16PS B tile (16 columns x
// one bf16 pair: the "VNNI" layout), so a B tile of 16 pairs is 512 consecutive code bytes, decoded
// into 1 KiB of bf16. The activations are decoded once per row panel (AVX-512, in parallel) into
// their A tiles, each 16 rows x 16 pairs = 1 KiB contiguous (a_tile_offset: K chunk by K chunk),
// so that tile loads walk memory in order. Every buffer a tile touches is 64-byte aligned and is
// the thread's scratch, kept between calls (scratch()).
//
// Blocking. Rows go in panels of kRowPanel; work items are groups of two column blocks (32
// columns; the last may have one), split over torch's threads; K goes in chunks of kChunkPairs
// pairs; every row chunk of up to 32 rows (two A tiles) runs its 2 x 2 C tiles over a chunk: per 16
// pairs (a step), two A-tile loads, two B-tile loads, four TDPBF16PS. With at most 32 rows
// (run_groups_single) each work item decodes its B tiles one step ahead of the tile loads into a
// two-step ring in L1, and C stays in the tiles over all of K. With more (run_groups_multi) the
// K chunks are the outer loop (a chunk's A tiles stay in L2 for all work items), two decoded B
// panels alternate (the row chunks running over one decode their share of the next), and C sums
// wait in the thread's scratch between K chunks (exact: fp32 stores and loads).
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
// (acc * sa[m]) * sb[n] (+ bias[n]) is fp32, rounded once to the output dtype: here to bf16
// (bf16_bits16, round to nearest even) with out_bf16, else by torch.
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "amx_tiles.h"
#include "decode.h"
#include "fp8ref_cpu.h"

namespace fp8ref {
namespace {

using amx::TileConfig;

// K pairs per K chunk (K = 2048 values): with more than 32 rows, the chunk's two decoded B panels
// (2 x 2 column blocks x 1024 pairs x 64 bytes = 256 KiB) and the A tiles of a 256-row panel (1 MiB)
// stay in L2. 1024 pairs was the fastest of the sizes tried (256 to 2048) at M = 128, 256 and 1024;
// smaller chunks with 1024-row panels (the weight decoded once instead of four times) were slower
// still: C then goes to and from DRAM every 256 pairs (docs/performance.md, "Figures behind the
// code").
constexpr int64_t kChunkPairs = 1024;
// Rows per row chunk (two A tiles), and columns per work item (two column blocks): the fp32 buffer
// of C is [rows][kGroupCols].
constexpr int64_t kRowChunk = 32, kGroupCols = 32;
// Rows per row panel: the A tiles of one K chunk of a panel (256 x 2048 bf16 = 1 MiB) and the
// decoded B panels share L2; every panel decodes the weight again.
constexpr int64_t kRowPanel = 256;

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
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void decode_panel_avx512(const uint8_t* pb, const uint8_t*,
                                                                                int64_t p0, int64_t p1, int64_t K2,
                                                                                uint16_t* dst) {
  for (int64_t p = p0; p < p1; ++p, dst += 32) {
    // One branch-free decode for every pair: a branch on sp[p] (pack_weight's zero-or-subnormal
    // flag) cost more than the table lookup it saved (a third of a random weight's pairs hold a
    // zero, so the branch mispredicts; docs/performance.md, "Figures behind the code").
    _mm512_storeu_si512(dst, p >= K2 ? _mm512_setzero_si512() : decode32_bf16(pb + p * 32));
  }
}

void decode_panel_scalar(const uint8_t* pb, const uint8_t*, int64_t p0, int64_t p1, int64_t K2, uint16_t* dst) {
  for (int64_t p = p0; p < p1; ++p, dst += 32)
    for (int i = 0; i < 32; ++i) dst[i] = p >= K2 ? 0 : bf16_of_code(pb[p * 32 + i]);
}

// Where the A tile of row block rb at step s starts: K chunk by K chunk, and within a chunk row
// block by row block ([chunk][row block][step in the chunk][16][32] bf16), so that a K chunk's A
// tiles are one contiguous region (1 MiB for a 256-row panel). Row block by row block over all of
// K had put each row block's part of a chunk at a stride of twice its size, a power of two (128 KiB
// at K = 4096) that maps every part to the same half of L2's sets: without any decoding, 256 rows
// took three times as long as 128 (docs/performance.md, "Figures behind the code").
inline int64_t a_tile_offset(int64_t rb, int64_t s, int64_t row_blocks, int64_t steps) {
  constexpr int64_t cs = kChunkPairs / 16;
  const int64_t c = s / cs, steps_c = std::min(cs, steps - c * cs);
  return (c * cs * row_blocks + rb * steps_c + (s - c * cs)) * 512;
}

// Activation row m's K codes -> its 32 bf16 values per step, at their place in each A tile, zeros
// beyond K: steps [s0, steps) one code at a time; the AVX-512 version takes the full steps first.
void decode_a_row_scalar(const uint8_t* row, int64_t K, int64_t m, int64_t row_blocks, int64_t steps, int64_t s0,
                         uint16_t* abuf) {
  for (int64_t s = s0; s < steps; ++s) {
    uint16_t* dst = abuf + (m % 16) * 32 + a_tile_offset(m / 16, s, row_blocks, steps);
    for (int i = 0; i < 32; ++i) dst[i] = 32 * s + i < K ? bf16_of_code(row[32 * s + i]) : 0;
  }
}

__attribute__((target("avx512f,avx512bw,avx512bf16"))) void decode_a_row_avx512(const uint8_t* row, int64_t K,
                                                                                int64_t m, int64_t row_blocks,
                                                                                int64_t steps, uint16_t* abuf) {
  uint16_t* const base = abuf + (m % 16) * 32;
  int64_t s = 0;
  for (; s < steps && 32 * s + 32 <= K; ++s)
    _mm512_store_si512(base + a_tile_offset(m / 16, s, row_blocks, steps), decode32_bf16(row + 32 * s));
  decode_a_row_scalar(row, K, m, row_blocks, steps, s, abuf);
}

void decode_a_row(const uint8_t* row, int64_t K, int64_t m, int64_t row_blocks, int64_t steps, uint16_t* abuf,
                  bool vec) {
  if (vec) decode_a_row_avx512(row, K, m, row_blocks, steps, abuf);
  else decode_a_row_scalar(row, K, m, row_blocks, steps, 0, abuf);
}

// Every tile's memory (A tiles, the decoded B panels, C buffers) starts on a 64-byte line: a tile
// load whose 64-byte rows straddle two lines took more than twice as long, from L1
// (docs/performance.md, "Figures behind the code"); malloc aligns to 16. And it is a
// thread's scratch, kept from call to call (grown, never shrunk): buffers made per call came from
// fresh pages (glibc maps blocks of 128 KiB and more anew), and the page faults on their first
// touch, with the tiles configured, took a third of a call in half the calls at M = 1024. What a
// thread keeps: its B panels (2 x 128 KiB), the C sums
// of its work items for a row panel (256 rows x its share of N x 4 bytes: 2 MiB of N = 4096 on two
// threads) and, on the calling thread, the A tiles of a row panel (256 x 2 K bytes).
struct AlignedFree {
  void operator()(char* p) const { ::operator delete[](p, std::align_val_t(64)); }
};
enum ScratchSlot { kPanelSlot, kCSlot, kASlot, kSlots };
template <class E>
E* scratch(ScratchSlot slot, int64_t n) {
  thread_local std::unique_ptr<char[], AlignedFree> bufs[kSlots];
  thread_local int64_t sizes[kSlots] = {};
  const int64_t bytes = std::max<int64_t>(64, n * (int64_t)sizeof(E));
  if (bytes > sizes[slot]) {
    bufs[slot].reset(new (std::align_val_t(64)) char[bytes]);
    sizes[slot] = bytes;
  }
  return reinterpret_cast<E*>(bufs[slot].get());
}

// The decoded B panel holds one K chunk of a work item step by step: step s (16 pairs) of column
// block j is the B tile at panel + s * kStepElems + j * 512 (bf16 elements; 1 KiB per tile).
constexpr int64_t kStepElems = 2 * 16 * 32;
// Steps by which the codes are prefetched ahead of their decoding.
constexpr int64_t kPrefetchSteps = 8;

using DecodePairs = void (*)(const uint8_t*, const uint8_t*, int64_t, int64_t, int64_t, uint16_t*);

// One B tile: pairs [p0, p0 + 16) of a column block (codes, flags: its packed codes and special
// flags) -> dst, and a prefetch of the codes kPrefetchSteps steps on (a prefetch never faults).
inline void decode_b_tile(DecodePairs fn, const uint8_t* codes, const uint8_t* flags, int64_t p0, int64_t K2,
                          uint16_t* dst) {
  fn(codes, flags, p0, p0 + 16, K2, dst);
  const uint8_t* ahead = codes + (p0 + 16 * kPrefetchSteps) * 32;
  for (int line = 0; line < 512; line += 64) _mm_prefetch((const char*)(ahead + line), _MM_HINT_T0);
}

// The B panel of one (K chunk, work item) decoded a few tiles at a time: more than 32 rows decode
// the next one's panel while they run the tiles over the current one, a quota per tile step spread
// over all of its row chunks, so that no tile load waits on a decode and the code stream overlaps
// the tiles (decoding it ahead of the first row chunk instead cost about twice what the same
// decode costs overlapping a small M's tiles: docs/performance.md, "Figures behind the code"). Tile
// t is block t % nt at step t / nt; the codes are prefetched kPrefetchSteps steps ahead.
struct PanelFill {
  const uint8_t* codes[2] = {nullptr, nullptr};
  const uint8_t* flags[2] = {nullptr, nullptr};
  int nt = 0;
  int64_t kc = 0, K2 = 0, done = 0, total = 0, quota = 0;
  uint16_t* panel = nullptr;
  DecodePairs fn = nullptr;
  void run(int64_t n) {
    for (int64_t i = 0; i < n && done < total; ++i, ++done) {
      const int64_t st = done / nt;
      const int j = (int)(done % nt);
      decode_b_tile(fn, codes[j], flags[j], kc + 16 * st, K2, panel + st * kStepElems + j * 512);
    }
  }
  void step() { run(quota); }
  void finish() { run(total); }
};

// One row chunk (MT A tiles) x NT column blocks over `steps` x 16 pairs. a: the chunk's first A
// tile at the K chunk's first step (the second A tile a_next elements on); c: C sums of the chunk's
// first row, row stride ldc_f floats. At most 32 rows (decode given): each step's B tiles are
// decoded one step ahead into `panel`, a two-step ring, so that decoding (AVX-512), the code stream
// and TDPBF16PS (AMX) overlap instead of taking turns (store -> tile-load order within the ring is
// program order, which the CPU keeps). More (pf given): `panel` holds the whole K chunk, decoded
// before, and each step decodes pf's quota of the next unit's panel.
template <class T, int MT, int NT, class Decode>
void tile_block(const uint16_t* a, int64_t a_next, uint16_t* panel, int64_t steps, float* c, int64_t ldc_f,
                bool load_c, bool keep, const Decode* decode, PanelFill* pf) {
  const int64_t ldc = ldc_f * 4;  // bytes
  auto slot = [&](int64_t s) { return panel + (decode ? (s & 1) : s) * kStepElems; };
  if (decode)
    for (int j = 0; j < NT; ++j) (*decode)(j, 0, slot(0) + j * 512);
  if (load_c) {
    T::template load<0>(c, ldc);
    if constexpr (NT > 1) T::template load<1>(c + 16, ldc);
    if constexpr (MT > 1) T::template load<2>(c + 16 * ldc_f, ldc);
    if constexpr (MT > 1 && NT > 1) T::template load<3>(c + 16 * ldc_f + 16, ldc);
  }
  for (int64_t s = 0; s < steps; ++s) {
    const uint16_t* b = slot(s);
    if (pf) pf->step();
    if (decode && s + 1 < steps)
      for (int j = 0; j < NT; ++j) (*decode)(j, s + 1, slot(s + 1) + j * 512);
    T::template load<4>(a + s * 512, 64);
    if constexpr (MT > 1) T::template load<5>(a + a_next + s * 512, 64);
    T::template load<6>(b, 64);
    if constexpr (NT > 1) T::template load<7>(b + 512, 64);
    T::template dpbf16ps<0, 4, 6>();
    if constexpr (NT > 1) T::template dpbf16ps<1, 4, 7>();
    if constexpr (MT > 1) T::template dpbf16ps<2, 5, 6>();
    if constexpr (MT > 1 && NT > 1) T::template dpbf16ps<3, 5, 7>();
  }
  if (keep) return;
  T::template store<0>(c, ldc);
  if constexpr (NT > 1) T::template store<1>(c + 16, ldc);
  if constexpr (MT > 1) T::template store<2>(c + 16 * ldc_f, ldc);
  if constexpr (MT > 1 && NT > 1) T::template store<3>(c + 16 * ldc_f + 16, ldc);
}

template <class T>
void zero_c(int mt, int nt) {
  T::template zero<0>();
  if (nt > 1) T::template zero<1>();
  if (mt > 1) T::template zero<2>();
  if (mt > 1 && nt > 1) T::template zero<3>();
}

struct Problem {
  const uint16_t* abuf;  // A tiles (a_tile_offset), bf16 bits, zero beyond K
  int64_t M, N, N16, K2, K2p;
  const uint8_t* pb;  // [N16][K2][16][2] codes
  const uint8_t* sp;  // [N16][K2]
  const float *sa, *sb, *bias;
  void* out;  // [M][N] fp32, or bf16 with out_bf16
  bool out_bf16, vec_decode;
};

// out[m, n] = (acc * sa[m]) * sb[n] (+ bias[n]) in fp32 for the work item's columns [n0, n1)
// (at most kGroupCols), then rounded once to bf16 with out_bf16; acc: its C sums, row m at acc + m *
// ld. Two roundings and an add, never fused (-ffp-contract=off), as the scalar loop.
void epilogue_scalar(const Problem& P, const float* acc, int64_t ld, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < P.M; ++m)
    for (int64_t n = n0; n < n1; ++n) {
      float y = acc[m * ld + (n - n0)] * P.sa[m];
      y = y * P.sb[n];
      if (P.bias) y = y + P.bias[n];
      if (P.out_bf16) ((uint16_t*)P.out)[m * P.N + n] = bf16_bits(y);
      else ((float*)P.out)[m * P.N + n] = y;
    }
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) void epilogue_avx512(const Problem& P, const float* acc, int64_t ld,
                                                         int64_t n0, int64_t n1) {
  for (int64_t h = n0; h < n1; h += 16) {
    const __mmask16 k = (__mmask16)((1u << std::min<int64_t>(16, n1 - h)) - 1);
    const __m512 sb = _mm512_maskz_loadu_ps(k, P.sb + h);
    const __m512 bias = P.bias ? _mm512_maskz_loadu_ps(k, P.bias + h) : _mm512_setzero_ps();
    for (int64_t m = 0; m < P.M; ++m) {
      __m512 y = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, acc + m * ld + (h - n0)), _mm512_set1_ps(P.sa[m]));
      y = _mm512_mul_ps(y, sb);
      if (P.bias) y = _mm512_add_ps(y, bias);
      if (P.out_bf16) _mm256_mask_storeu_epi16((uint16_t*)P.out + m * P.N + h, k, bf16_bits16(y));
      else _mm512_mask_storeu_ps((float*)P.out + m * P.N + h, k, y);
    }
  }
}

// At most 32 rows (one row chunk): per work item, K chunk by K chunk with C in the tiles over all
// of K, the B tiles decoded one step ahead into a two-step ring.
template <class T>
void run_groups_single(const Problem& P, int64_t g0, int64_t g1) {
  uint16_t* const panel = scratch<uint16_t>(kPanelSlot, 2 * kStepElems);
  float* const cacc = scratch<float>(kCSlot, kRowChunk * kGroupCols);
  const DecodePairs decode_pairs = P.vec_decode ? decode_panel_avx512 : decode_panel_scalar;
  const int r0 = (int)std::min<int64_t>(16, P.M), r1 = (int)std::max<int64_t>(0, P.M - 16);
  const int mt = r1 > 0 ? 2 : 1;
  TileConfig current;
  bool configured = false;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t nb0 = 2 * g;
    const int nt = (int)std::min<int64_t>(2, P.N16 - nb0);
    const uint8_t* codes[2] = {P.pb + nb0 * P.K2 * 32, P.pb + (nb0 + nt - 1) * P.K2 * 32};
    const uint8_t* flags[2] = {P.sp + nb0 * P.K2, P.sp + (nb0 + nt - 1) * P.K2};
    const TileConfig cfg = make_config(r0, r1, nt);
    if (!configured || !amx::same_config(cfg, current)) {
      T::configure(cfg);
      current = cfg;
      configured = true;
    }
    zero_c<T>(mt, nt);
    for (int64_t kc = 0; kc < P.K2p; kc += kChunkPairs) {
      const int64_t kp = std::min(kChunkPairs, P.K2p - kc), steps = kp / 16;  // a multiple of 16 pairs
      // Step s of this K chunk, column block j -> dst.
      const auto decode = [&](int j, int64_t s, uint16_t* dst) {
        decode_b_tile(decode_pairs, codes[j], flags[j], kc + 16 * s, P.K2, dst);
      };
      const bool keep = kc + kp < P.K2p;
      const uint16_t* a = P.abuf + a_tile_offset(0, kc / 16, mt, P.K2p / 16);
      float* c = cacc;
      uint16_t* pan = panel;
      if (mt == 2 && nt == 2) tile_block<T, 2, 2>(a, steps * 512, pan, steps, c, kGroupCols, false, keep, &decode, nullptr);
      else if (mt == 2) tile_block<T, 2, 1>(a, steps * 512, pan, steps, c, kGroupCols, false, keep, &decode, nullptr);
      else if (nt == 2) tile_block<T, 1, 2>(a, steps * 512, pan, steps, c, kGroupCols, false, keep, &decode, nullptr);
      else tile_block<T, 1, 1>(a, steps * 512, pan, steps, c, kGroupCols, false, keep, &decode, nullptr);
    }
    const int64_t n0 = nb0 * 16, n1 = std::min(P.N, (nb0 + nt) * 16);
    (P.vec_decode ? epilogue_avx512 : epilogue_scalar)(P, cacc, kGroupCols, n0, n1);
  }
  if (configured) T::release();
}

// More than 32 rows: K chunk by K chunk, and within a chunk work item by work item, so that the
// chunk's A tiles (1 MiB at 256 rows) stay in L2 while every work item of the thread runs over
// them. (Work items outside, K chunks inside, had read all of A, 2 MiB at 256 rows, from beyond L2
// for every work item: without any decoding, 256 rows took three times as long as 128.) Two B
// panels alternate: every row chunk runs its tiles over the current
// (K chunk, work item)'s panel and decodes its quota of the next one's (PanelFill). C sums wait
// between K chunks in the thread's scratch ([work item][rows][32] fp32), not in the output: the
// output's pages are new on most calls, and their first touch by tile stores with the tiles
// configured made half the calls at M = 1024 take 40 % longer; the epilogue writes the
// output after the tiles are released.
template <class T>
void run_groups_multi(const Problem& P, int64_t g0, int64_t g1) {
  const int64_t chunk_elems = kChunkPairs / 16 * kStepElems;
  uint16_t* const panels = scratch<uint16_t>(kPanelSlot, 2 * chunk_elems);
  const int64_t rcs = (P.M + kRowChunk - 1) / kRowChunk, row_blocks = (P.M + 15) / 16;
  const int64_t c_elems = rcs * kRowChunk * kGroupCols;  // one work item's C sums, [rows][32]
  float* const csums = scratch<float>(kCSlot, (g1 - g0) * c_elems);
  const DecodePairs decode_pairs = P.vec_decode ? decode_panel_avx512 : decode_panel_scalar;
  // The units, in order: (K chunk kc, work item g), kc outer.
  auto fill_for = [&](int64_t kc, int64_t g, uint16_t* panel) {
    PanelFill f;
    const int64_t nb0 = 2 * g;
    f.nt = (int)std::min<int64_t>(2, P.N16 - nb0);
    f.codes[0] = P.pb + nb0 * P.K2 * 32;
    f.codes[1] = P.pb + (nb0 + f.nt - 1) * P.K2 * 32;
    f.flags[0] = P.sp + nb0 * P.K2;
    f.flags[1] = P.sp + (nb0 + f.nt - 1) * P.K2;
    f.kc = kc;
    f.K2 = P.K2;
    f.total = f.nt * (std::min(kChunkPairs, P.K2p - kc) / 16);
    f.panel = panel;
    f.fn = decode_pairs;
    return f;
  };
  TileConfig current;
  bool configured = false;
  int cur = 0;
  {
    PanelFill first = fill_for(0, g0, panels);
    first.finish();
  }
  for (int64_t kc = 0; kc < P.K2p; kc += kChunkPairs) {
    const int64_t kp = std::min(kChunkPairs, P.K2p - kc), steps = kp / 16;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t nb0 = 2 * g;
      const int nt = (int)std::min<int64_t>(2, P.N16 - nb0);
      const bool last_g = g + 1 >= g1;
      const int64_t nkc = last_g ? kc + kp : kc, ng = last_g ? g0 : g + 1;
      PanelFill next;  // the next unit's panel, into the other buffer
      if (nkc < P.K2p) {
        next = fill_for(nkc, ng, panels + (cur ^ 1) * chunk_elems);
        next.quota = (next.total + rcs * steps - 1) / (rcs * steps);
      }
      float* const cg = csums + (g - g0) * c_elems;
      constexpr int64_t ldc = kGroupCols;
      uint16_t* pan = panels + cur * chunk_elems;
      for (int64_t mc = 0; mc < P.M; mc += kRowChunk) {
        const int r0 = (int)std::min<int64_t>(16, P.M - mc);
        const int r1 = (int)std::min<int64_t>(16, std::max<int64_t>(0, P.M - mc - 16));
        const TileConfig cfg = make_config(r0, r1, nt);
        if (!configured || !amx::same_config(cfg, current)) {
          T::configure(cfg);  // (zeroes every tile: C is in memory here)
          current = cfg;
          configured = true;
        }
        const int mt = r1 > 0 ? 2 : 1;
        if (kc == 0) zero_c<T>(mt, nt);
        const uint16_t* a = P.abuf + a_tile_offset(mc / 16, kc / 16, row_blocks, P.K2p / 16);
        float* c = cg + mc * ldc;
        using NoDecode = void (*)(int, int64_t, uint16_t*);
        const NoDecode* none = nullptr;
        const bool load_c = kc > 0;
        if (mt == 2 && nt == 2) tile_block<T, 2, 2>(a, steps * 512, pan, steps, c, ldc, load_c, false, none, &next);
        else if (mt == 2) tile_block<T, 2, 1>(a, steps * 512, pan, steps, c, ldc, load_c, false, none, &next);
        else if (nt == 2) tile_block<T, 1, 2>(a, steps * 512, pan, steps, c, ldc, load_c, false, none, &next);
        else tile_block<T, 1, 1>(a, steps * 512, pan, steps, c, ldc, load_c, false, none, &next);
      }
      next.finish();  // (what the quota left: the last row chunk may have fewer steps' worth)
      cur ^= 1;
    }
  }
  if (configured) T::release();
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n0 = 2 * g * 16, n1 = std::min(P.N, n0 + 32);
    (P.vec_decode ? epilogue_avx512 : epilogue_scalar)(P, csums + (g - g0) * c_elems, kGroupCols, n0, n1);
  }
}

template <class T>
void run_groups(const Problem& P, int64_t g0, int64_t g1) {
  if (P.M <= kRowChunk) run_groups_single<T>(P, g0, g1);
  else run_groups_multi<T>(P, g0, g1);
}

}  // namespace

std::string amx_status() {
  static const std::string status = []() -> std::string {
    // The AMX bits straight from CPUID (leaf 7: EDX bit 24 amx-tile, 22 amx-bf16), so that a CPU
    // with AMX whose OS has not enabled the tile state in XCR0 (bits 17, 18; Linux < 5.16) is told
    // apart from a CPU without it: /proc/cpuinfo lists the flags in the first case.
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool leaf7 = __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx);
    std::string missing;
    if (!leaf7 || !(edx & (1u << 24))) missing += " amx_tile";
    if (!leaf7 || !(edx & (1u << 22))) missing += " amx_bf16";
    if (!__builtin_cpu_supports("avx512f")) missing += " avx512f";
    if (!__builtin_cpu_supports("avx512bw")) missing += " avx512bw";
    if (!__builtin_cpu_supports("avx512bf16")) missing += " avx512_bf16";
    if (!missing.empty()) return "this CPU lacks" + missing;
    unsigned xcr0_lo = 0, xcr0_hi = 0;
    asm volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));  // (OSXSAVE: implied by avx512f above)
    if ((xcr0_lo & (3u << 17)) != (3u << 17))
      return "the OS has not enabled AMX tile state (XCR0 bits 17-18 clear; Linux enables it from 5.16)";
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
                             at::Tensor sb, at::Tensor bias, bool has_bias, bool emulate, bool out_bf16) {
  const CsrGuard csr;  // IEEE subnormals on this thread, whatever the caller set
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
  auto out = at::empty({M, N}, at::dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
  if (M == 0 || N == 0) return out;
  const int64_t K2p = (K2 + 15) / 16 * 16, steps = K2p / 16;
  // The activations' codes -> their exact bf16 bits, laid out as the A tiles (one 1 KiB tile of 16
  // rows x 32 values per row block and step, contiguous: tile loads of stride 64 bytes that walk
  // memory in order). Rows beyond M in the last row block are never read (their tiles are
  // configured with fewer rows), so they are left unwritten. The rows go in panels of kRowPanel
  // (a K chunk of their A tiles, 1 MiB, stays in L2), each written straight into `out`.
  const int64_t panel_rows = std::min(M, kRowPanel);
  uint16_t* const abuf = scratch<uint16_t>(kASlot, (panel_rows + 15) / 16 * steps * 512);
  const uint8_t* ap = a.data_ptr<uint8_t>();
  const bool vec = has_bf16_dot();
  for (int64_t r0 = 0; r0 < M; r0 += kRowPanel) {
    const int64_t rows = std::min(kRowPanel, M - r0);
    at::parallel_for(0, rows, 16, [&](int64_t m0, int64_t m1) {
      const CsrGuard csr;
      for (int64_t m = m0; m < m1; ++m)
        decode_a_row(ap + (r0 + m) * K, K, m, (rows + 15) / 16, steps, abuf, vec);
    });
    const Problem P{abuf,
                    rows,
                    N,
                    N16,
                    K2,
                    K2p,
                    pb.data_ptr<uint8_t>(),
                    special.data_ptr<uint8_t>(),
                    sa.data_ptr<float>() + r0,
                    sb.data_ptr<float>(),
                    has_bias ? bias.data_ptr<float>() : nullptr,
                    (char*)out.data_ptr() + r0 * N * out.element_size(),
                    out_bf16,
                    vec};
    const int64_t groups = (N16 + 1) / 2;
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      const CsrGuard csr;
      if (emulate) run_groups<amx::EmuTiles>(P, g0, g1);
      else run_groups<amx::RealTiles>(P, g0, g1);
    });
  }
  return out;
}

// One TDPBF16PS on explicit tiles, emulated: C [m, n] fp32 += A [m, 2k] bf16 . B [k, 2n] bf16
// (B in the pair layout). For tests of the emulation's semantics and of its fault checks.
at::Tensor amx_emu_tdpbf16ps(at::Tensor c, at::Tensor a, at::Tensor b) {
  const CsrGuard csr;  // IEEE subnormals on this thread, whatever the caller set
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
