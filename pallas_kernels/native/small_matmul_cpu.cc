// Small-M fp32 matmul for the CPU as an XLA FFI custom call: y[M, N] = x[M, K] @ W[K, N], with W
// either [K, N] or one layer of a stacked [L, K, N] picked by a runtime layer index (so the
// decoder's layer loop hands the stacked weights in as stored and no per-layer slice is copied).
//
// Why it exists: XLA:CPU runs the decode step's projections (M = 1..48 rows against weights of
// 576 x 1536 and the like) at a third of the bandwidth the weights could be read at (issue #21);
// at small M the work is reading W once, so the kernel is organised around that:
//   threads  split N into column panels (whole 64-column tiles, about 4 a thread, at most
//            kPanelMax wide; a prefill call of few panels splits its rows too: packed_products),
//            items taken from an atomic counter on XLA's intra-op pool (the FFI ThreadPool
//            context, as the attention kernel);
//   a panel  is read kChunk (16) W rows at a time, each row's piece in ascending order, so the
//            hardware prefetcher follows a few streams; reading a 64-column tile down all K rows
//            instead (256 bytes from each of K pages) ran at ~10 GB/s, software prefetch or not;
//            the chunk then stays in L1 / L2 for every row block of x;
//   registers a block of kRows (6) rows x kVecs vectors of columns accumulates over the chunk with
//            FMA (AVX-512: 6 rows x 4 x 16 columns in 24 registers; AVX2: 6 x 2 x 8 in 12), then
//            goes to y until the next chunk; columns left over past the vectors go one at a time.
//            6 rows against 4 measured ~20% faster at 48 rows, the same at 8 (noisy machine).
//            AVX2 blocks of 1-3 rows are wider (vecs_for), and the packed layout's chunked loop
//            takes AVX2 rows 3 at a time (kChunkRows), so W rows are read in longer pieces.
// The packed layout (packed_panel) adds: the next 16 KB chunk prefetched into L2 while the row
// blocks read this one, a share each (10-20% at 1-16 rows against none; shared out against the
// first block issuing it all: another 10-20% at 4-64 rows), and, above kGemmLoopAbove rows
// (128 with AVX-512, 64 with AVX2 and scalar builds: prefill chunks), a GEMM loop
// (packed_panel_rows) that beat XLA's dot at 512 rows (200 against 195 GFLOP/s on 576 x 1536),
// so prefill needs no unpacked copy of the weights; its row blocks prefetch the item's next
// tile, a share each, while they compute on this one (the engine's step, interleaved A/B: 20
// rows 67-75 -> 62-64 ms, 14 rows 48 -> 45-47).
// The packed entries take W in fp32 or bf16 (a bf16 model's weights): each bf16 W vector is
// widened to fp32 in registers as it is loaded (a bf16 is the top half of its fp32: exact), so
// the product is the fp32 one of the widened weight, bit for bit, from half the bytes.
// The packed entry computes only the first `rows` (live) rows: a step's bucket padding is zeros.
// The packed-many entry runs several packed products of one x (a layer's q, k and v; gate and
// up) as one call: their work items go to the pool together, one hand-off and one wait instead of
// one each (batch-1 engine decode 43.2 / 42.9 -> 44.1 / 45.1 tok/s on the Xeon, 2026-12-07).
// Determinism: every output y[m, n] is the same chain, fma over k = 0 .. K-1 in order starting from
// 0, whatever the row block, the vector width, the thread or the batch: the work is split along N
// (and, in prefill, into groups of rows), never along K, so each output is computed whole by one
// item and a row's result is bit-identical whatever its batch mates and the thread count
// (tests/test_native_matmul.py). The scalar path uses std::fma for the same chain.
// Without AVX2 + FMA (another CPU) the same loops compile as plain scalar C++.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define JAXSERVE_VEC 16
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define JAXSERVE_VEC 8
#endif

#include "build_info.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTileN = 64;  // columns per register block; work items are whole tiles
constexpr int kRows = 6;        // rows of x per register block
constexpr int64_t kPanelMax = 4096;  // widest work item, columns (measured: 1024 lost ~20% at M = 1)
constexpr int64_t kChunk = 16;       // W rows per pass over a panel (measured: 64 lost ~40% at M = 1)
// The packed kernel's chunked loop prefetches the next chunk into L2 while it computes on this
// one (its tiles are one contiguous stream: the next 16 KB, the next tile's first chunk after a
// tile's last), its row blocks a share each (one block: the row kPrefetchAhead floats ahead of
// each W row it reads).
constexpr int64_t kPrefetchAhead = 64 * kTileN;

#ifdef JAXSERVE_VEC
#if JAXSERVE_VEC == 16
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vset1(float x) { return _mm512_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
// 16 bf16 weights widened to fp32: a bf16 is the top half of its fp32, so zero-extend, shift.
inline Vec vload(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
#else
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vset1(float x) { return _mm256_set1_ps(x); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vload(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
#endif
// vectors of columns per register block: R x V accumulators + V loaded W vectors must fit the
// register file with the broadcast x (AVX-512: 24 + 4 + 1 of 32 zmm; AVX2: 12 + 2 + 1 of 16 ymm)
constexpr int kVecs = JAXSERVE_VEC == 16 ? 4 : 2;
// ...except AVX2 blocks of few rows, which take wider blocks: 1 row x 8 vectors (a whole 64-column
// tile row, 8 accumulators, W as FMA memory operands) and 2-3 rows x 4 (half a tile, 12 + 1). A
// block then reads each 256-byte W row in one or two contiguous pieces, not four 64-byte pieces
// in four passes over the chunk: on a 2-core Intel Xeon (AVX-512 and AMX, 2026-12-06) the AVX2
// build's packed product at 1 row went from 20 to 25.7 GB/s (the AVX-512 build's figure) and at
// 2-3 rows from 16 to 23 (bench_small_matmul, cold W, 576 x 1536).
constexpr int vecs_for(int R) {
  if (JAXSERVE_VEC == 16) return kVecs;
  return R == 1 ? 8 : R <= 3 ? 4 : kVecs;
}
#define VEC_OR_1 JAXSERVE_VEC

// How a register block also prefetches W into L2 while it computes: kAhead, for each W row
// read, the row kPrefetchAhead floats further on (packed_panel's chunks when one row block
// reads them); kRange1 / kRange2, one / two 64-byte lines per W row read from [pf->next,
// pf->end) until that is used up (a row block's share of the next chunk in packed_panel, of
// the next tile in packed_panel_rows). The line count is a template constant: a runtime count
// cost 3-4% at 8 and 16 rows (AVX2, cold W).
enum class Prefetch { kNone, kAhead, kRange1, kRange2 };
struct PrefetchRange {
  const char* next;
  const char* end;
};

// Row block b of `blocks`' share of the `bytes` from `start` (line-aligned start; the shares
// cover the whole range): what the blocks that compute on one piece of W prefetch of the next.
inline PrefetchRange share_of(const char* start, int64_t bytes, int64_t b, int64_t blocks) {
  return {start + bytes * b / blocks / 64 * 64, start + bytes * (b + 1) / blocks};
}

// y[r, c0 .. c0 + V * VEC) for R rows: acc = fma(x[r, k], w[k, c], acc), k in order.
template <int R, int V, Prefetch PF = Prefetch::kNone, typename W>
inline void block(const float* x, int64_t K, int64_t k0, int64_t k1, const W* w, int64_t ldw, int64_t N,
                  float* y, int64_t c0, PrefetchRange* pf = nullptr) {
  Vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = k0 == 0 ? vzero() : vload(y + r * N + c0 + v * JAXSERVE_VEC);
  const W* wp = w + k0 * ldw + c0;
  constexpr bool kRanged = PF == Prefetch::kRange1 || PF == Prefetch::kRange2;
  const char* pf_next = kRanged ? pf->next : nullptr;
  for (int64_t k = k0; k < k1; ++k, wp += ldw) {
    if constexpr (PF == Prefetch::kAhead) {  // one prefetch per 64-byte line of the block's V vectors
      const char* ahead = reinterpret_cast<const char*>(wp + kPrefetchAhead);
      for (int b = 0; b < V * JAXSERVE_VEC * int(sizeof(W)); b += 64) __builtin_prefetch(ahead + b, 0, 2);
    }
    if constexpr (kRanged) {
      if (pf_next < pf->end) {
        __builtin_prefetch(pf_next, 0, 2);
        if constexpr (PF == Prefetch::kRange2) __builtin_prefetch(pf_next + 64, 0, 2);
        pf_next += PF == Prefetch::kRange2 ? 128 : 64;
      }
    }
    Vec wv[V];
    for (int v = 0; v < V; ++v) wv[v] = vload(wp + v * JAXSERVE_VEC);
    for (int r = 0; r < R; ++r) {
      Vec xv = vset1(x[r * K + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = vfma(xv, wv[v], acc[r][v]);
    }
  }
  if constexpr (kRanged) pf->next = pf_next;
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) vstore(y + r * N + c0 + v * JAXSERVE_VEC, acc[r][v]);
}

template <int R, Prefetch PF = Prefetch::kNone, typename W>
inline void rows_vec(const float* x, int64_t K, int64_t k0, int64_t k1, const W* w, int64_t ldw, int64_t N,
                     float* y, int64_t c0, int64_t c1, PrefetchRange* pf) {
  constexpr int V = vecs_for(R);
  int64_t c = c0;
  for (; c + V * JAXSERVE_VEC <= c1; c += V * JAXSERVE_VEC)
    block<R, V, PF>(x, K, k0, k1, w, ldw, N, y, c, pf);
  for (; c + JAXSERVE_VEC <= c1; c += JAXSERVE_VEC) block<R, 1, Prefetch::kNone>(x, K, k0, k1, w, ldw, N, y, c);
}
#else
#define VEC_OR_1 1
#endif

inline float widen(float w) { return w; }
inline float widen(uint16_t w) {  // a bf16 weight's bits: the top half of its fp32
  const uint32_t bits = uint32_t(w) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The columns [c0, c1) of R rows one at a time, k in [k0, k1): the same fma chain as the vector lanes.
template <typename W>
inline void rows_scalar(const float* x, int64_t R, int64_t K, int64_t k0, int64_t k1, const W* w, int64_t ldw,
                        int64_t N, float* y, int64_t c0, int64_t c1) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = c0; c < c1; ++c) {
      float acc = k0 == 0 ? 0.f : y[r * N + c];
      for (int64_t k = k0; k < k1; ++k) acc = std::fma(x[r * K + k], widen(w[k * ldw + c]), acc);
      y[r * N + c] = acc;
    }
}

#ifdef JAXSERVE_VEC
template <Prefetch PF, typename W>
inline void rows_any_pf(const float* x, int64_t R, int64_t K, int64_t k0, int64_t k1, const W* w, int64_t ldw,
                        int64_t N, float* y, int64_t c0, int64_t c1, PrefetchRange* pf) {
  switch (R) {
    case 6: rows_vec<6, PF>(x, K, k0, k1, w, ldw, N, y, c0, c1, pf); break;
    case 5: rows_vec<5, PF>(x, K, k0, k1, w, ldw, N, y, c0, c1, pf); break;
    case 4: rows_vec<4, PF>(x, K, k0, k1, w, ldw, N, y, c0, c1, pf); break;
    case 3: rows_vec<3, PF>(x, K, k0, k1, w, ldw, N, y, c0, c1, pf); break;
    case 2: rows_vec<2, PF>(x, K, k0, k1, w, ldw, N, y, c0, c1, pf); break;
    default: rows_vec<1, PF>(x, K, k0, k1, w, ldw, N, y, c0, c1, pf); break;
  }
}

template <typename W>
inline void rows_any(const float* x, int64_t R, int64_t K, int64_t k0, int64_t k1, const W* w, int64_t ldw,
                     int64_t N, float* y, int64_t c0, int64_t c1, Prefetch mode = Prefetch::kNone,
                     PrefetchRange* pf = nullptr) {
  switch (mode) {
    case Prefetch::kAhead: rows_any_pf<Prefetch::kAhead>(x, R, K, k0, k1, w, ldw, N, y, c0, c1, pf); break;
    case Prefetch::kRange1: rows_any_pf<Prefetch::kRange1>(x, R, K, k0, k1, w, ldw, N, y, c0, c1, pf); break;
    case Prefetch::kRange2: rows_any_pf<Prefetch::kRange2>(x, R, K, k0, k1, w, ldw, N, y, c0, c1, pf); break;
    default: rows_any_pf<Prefetch::kNone>(x, R, K, k0, k1, w, ldw, N, y, c0, c1, pf); break;
  }
}
#endif

// Every row of x against the columns [c0, c1) of w (a panel), kChunk rows of W at a time: the
// chunk's rows are read in order along the panel (a few ascending streams the hardware prefetcher
// follows, not one 256-byte piece of each of K pages), then stay in L1 / L2 for the later row
// blocks; the accumulators go to y between chunks (a stored float reloads exactly, so the chain
// is unchanged).
void panel(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y, int64_t c0, int64_t c1) {
  const int64_t vec_end = c0 + (c1 - c0) / VEC_OR_1 * VEC_OR_1;
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t k1 = std::min(K, k0 + kChunk);
    for (int64_t cb = c0; cb < c1; cb += kTileN) {
      const int64_t ce = std::min(c1, cb + kTileN);
      for (int64_t m = 0; m < M; m += kRows) {
        const int64_t R = std::min<int64_t>(kRows, M - m);
        const float* xr = x + m * K;
        float* yr = y + m * N;
        const int64_t cv = std::min(ce, vec_end);
#ifdef JAXSERVE_VEC
        rows_any(xr, R, K, k0, k1, w, N, N, yr, cb, cv);
#endif
        rows_scalar(xr, R, K, k0, k1, w, N, N, yr, std::max(cb, cv), ce);
      }
    }
  }
}

// The packed layout: W as [T, K, 64] (T = ceil(N / 64), the last tile zero-padded), tile t
// holding columns [64 t, 64 t + 64) row after row, so one tile down all K rows is one contiguous
// stream. Tiles [t0, t1), kPackedChunk W rows at a time (16 KB, stays in L1 for every row block).
// Same fma chain per output as panel(): k in order from 0, y holding the partial sums between
// chunks.
constexpr int64_t kPackedChunk = 64;
// Rows of x per register block in the chunked loop: AVX2 takes 3 (x 4 vectors, above) where
// AVX-512 takes kRows, since the wider block read in order beat 6 x 2 at every row count measured
// (same Xeon, ms a product, 576 x 1536, 6 x 2 -> 3 x 4: 4 rows 0.197 -> 0.162, 8: 0.229 -> 0.195,
// 16: 0.291 -> 0.261, 24: 0.352 -> 0.334, 48: 0.588 -> 0.548; the other three shapes alike). The
// GEMM loop keeps 6 x 2: 3 x 4 there was within the noise at 128 and 512 rows.
constexpr int64_t kChunkRows = VEC_OR_1 == 8 ? 3 : kRows;
constexpr int64_t kPanelRows = 48;  // rows of x per panel in packed_panel_rows
// Products of more rows take packed_panel_rows. The chunked loop reads each 16 KB chunk once, in
// order, from DRAM and serves every row block (and AVX2's two or four column blocks a tile) from
// L1; the GEMM loop reads a tile's 256-byte W rows in 64-byte pieces per column block (a strided
// stream the hardware prefetcher serves badly) but keeps its accumulators in registers over all K
// and x in L2 past 64 rows. Measured (AVX2 build on a 2-core Zen 4, 2026-12-06; bench_small_matmul,
// cold W, ms a product, 576 x 1536, chunked against GEMM loop): 16 rows 0.20 / 0.34, 24: 0.27 /
// 0.43, 48: 0.49 / 0.63, 64: 0.67 / 0.69; 512: 4.87 / 4.44. AVX-512 took the GEMM loop above 12
// rows until the chunked loop's prefetch was shared out over its row blocks; since, on the 2-core
// Xeon (2026-12-07), the chunked loop is faster at 16-64 rows in the engine's decode step
// (profile_decode, interleaved A/B, step ms, switching above 12 rows -> above 64: 16 rows 53.1 /
// 53.5 -> 48.8 / 46.4, 24: 64.1 / 66.0 -> 56.3 / 53.1, 48: 107.5 / 107.3 -> 103.1 / 93.2) and in
// isolation up to 256 rows (a scratch harness, cold W, 576 x 1536: 96 rows 0.65 -> 0.57 ms, 128:
// 0.87 -> 0.78), the GEMM loop still ahead at 512 (3.19 against 3.25); bench_offline with 128-token
// steps (--max-num-batched-tokens 128), two interleaved runs: the 128-row bucket 149.1 / 147.4 ->
// 141.6 / 143.9 ms. So AVX-512 switches above 128 rows (x then at most 128 rows x K floats: 768 KB
// at SmolLM2's largest K, within the L2 of the machines measured), AVX2 (and the scalar build)
// above 64 (its GEMM loop faster at 96-256 rows: 0.98 against 1.03 ms at 96, 1.29 against 1.40 at
// 128).
constexpr int64_t kGemmLoopAbove = VEC_OR_1 == 16 ? 128 : 64;
static_assert(kPrefetchAhead == kPackedChunk * kTileN, "prefetch one packed chunk ahead");
template <typename W>
void packed_panel_rows(const float* x, int64_t M, int64_t K, const W* w, int64_t N, float* y, int64_t t0,
                       int64_t t1);

// W: float, or uint16_t for bf16 weights (widened in registers; half the bytes streamed).
template <typename W>
void packed_panel(const float* x, int64_t M, int64_t K, const W* w, int64_t N, float* y, int64_t t0,
                  int64_t t1) {
  constexpr int64_t kChunkBytes = kPackedChunk * kTileN * int64_t(sizeof(W));
  if (M > kGemmLoopAbove) {
    packed_panel_rows(x, M, K, w, N, y, t0, t1);
    return;
  }
  const int64_t blocks = (M + kChunkRows - 1) / kChunkRows;
  for (int64_t t = t0; t < t1; ++t) {
    const W* wt = w + t * K * kTileN;
    const int64_t cb = t * kTileN, ce = std::min(N, cb + kTileN);
    const int64_t cv = cb + (ce - cb) / VEC_OR_1 * VEC_OR_1;
    for (int64_t k0 = 0; k0 < K; k0 += kPackedChunk) {
      const int64_t k1 = std::min(K, k0 + kPackedChunk);
      for (int64_t m = 0, b = 0; m < M; m += kChunkRows, ++b) {
        const int64_t R = std::min<int64_t>(kChunkRows, M - m);
        const float* xr = x + m * K;
        float* yr = y + m * N;
        // the tile's columns are at wt - cb + c, row stride 64
#ifdef JAXSERVE_VEC
        if (blocks == 1) {
          rows_any(xr, R, K, k0, k1, wt - cb, kTileN, N, yr, cb, cv, Prefetch::kAhead);
        } else {
          // Each row block prefetches its share of the next chunk (the next 16 KB of the stream),
          // at a line or two per W row read, so DRAM streams it while all the blocks compute on
          // this chunk; the first block alone issuing every prefetch left the memory idle for the
          // rest of the chunk (measured in the file header and at kGemmLoopAbove).
          const char* next = reinterpret_cast<const char*>(wt + k0 * kTileN + kPrefetchAhead);
          PrefetchRange pf = share_of(next, kChunkBytes, b, blocks);
          const int64_t reads = (k1 - k0) * ((cv - cb) / (vecs_for(int(R)) * VEC_OR_1));
          const bool one_line = (pf.end - pf.next + 63) / 64 <= reads;
          rows_any(xr, R, K, k0, k1, wt - cb, kTileN, N, yr, cb, cv, one_line ? Prefetch::kRange1 : Prefetch::kRange2,
                   &pf);
        }
#endif
        rows_scalar(xr, R, K, k0, k1, wt - cb, kTileN, N, yr, cv, ce);
      }
    }
  }
}

// More than kGemmLoopAbove rows (prefill chunks): rows in panels of
// kPanelRows (a panel of x stays in L2 while every tile of the item passes over it), and each
// 6-row block accumulates a tile's 64 columns over the whole K in registers, the tile (K x 256
// bytes) read from L2. The chunked loop above
// reloads every row block's accumulators and re-reads x from L3 per tile once x outgrows L2.
// Same fma chain per output (k in order from 0).
template <typename W>
void packed_panel_rows(const float* x, int64_t M, int64_t K, const W* w, int64_t N, float* y, int64_t t0,
                       int64_t t1) {
  const int64_t tile_bytes = K * kTileN * int64_t(sizeof(W));
  for (int64_t m0 = 0; m0 < M; m0 += kPanelRows) {
    const int64_t m1 = std::min(M, m0 + kPanelRows);
    const int64_t blocks = (m1 - m0 + kRows - 1) / kRows;
    for (int64_t t = t0; t < t1; ++t) {
      const W* wt = w + t * K * kTileN;
      const int64_t cb = t * kTileN, ce = std::min(N, cb + kTileN);
      const int64_t cv = cb + (ce - cb) / VEC_OR_1 * VEC_OR_1;
      // In the first panel, each row block prefetches its share of the item's next tile into
      // L2, so DRAM streams it while this tile computes from L2 (later panels find the item's
      // tiles in L2 already).
      const char* next = t + 1 < t1 && m0 == 0 ? reinterpret_cast<const char*>(wt + K * kTileN) : nullptr;
      for (int64_t m = m0, b = 0; m < m1; m += kRows, ++b) {
        const int64_t R = std::min<int64_t>(kRows, m1 - m);
        const float* xr = x + m * K;
        float* yr = y + m * N;
#ifdef JAXSERVE_VEC
        PrefetchRange pf{};
        if (next) pf = share_of(next, tile_bytes, b, blocks);
        rows_any(xr, R, K, 0, K, wt - cb, kTileN, N, yr, cb, cv, next ? Prefetch::kRange2 : Prefetch::kNone, &pf);
#endif
        rows_scalar(xr, R, K, 0, K, wt - cb, kTileN, N, yr, cv, ce);
      }
    }
  }
}

// Runs fn(i) for i in [0, total) on up to `threads` threads of XLA's intra-op pool, the calling
// thread included, and returns when every item is done.
void parallel_for(int64_t total, int64_t num_threads, ffi::ThreadPool& pool,
                  const std::function<void(int64_t)>& run_fn) {
  // As in the attention kernel: the counters live in a shared_ptr held by every scheduled task, so
  // a task the pool starts after the work is done reads `next` (past the end) and returns without
  // touching this frame; an item is only claimed while next < total, before this call returns.
  struct Counters {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto counters = std::make_shared<Counters>();
  int64_t threads = num_threads;
  auto work = [counters, total, fn = &run_fn]() {
    for (int64_t n; (n = counters->next.fetch_add(1)) < total;) {
      (*fn)(n);
      counters->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(threads, total) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));  // a copy per task
  work();  // the calling thread works too: nothing waits on a pool thread that never starts
  while (counters->done.load(std::memory_order_acquire) < total) std::this_thread::yield();
}

int64_t thread_count(int64_t num_threads, ffi::ThreadPool& pool) {
  int64_t threads = num_threads > 0 ? num_threads : pool.num_threads();
  if (threads < 1) threads = std::max(1u, std::thread::hardware_concurrency());
  return threads;
}

ffi::Error SmallMatmulCpu(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> layer_buf,
                          ffi::ResultBuffer<ffi::F32> out, int64_t num_threads, ffi::ThreadPool pool) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto od = out->dimensions();
  if (xd.size() != 2 || (wd.size() != 2 && wd.size() != 3) || od.size() != 2) {
    return ffi::Error::InvalidArgument("small_matmul_cpu: x must be [M, K], w [K, N] or [L, K, N], out [M, N]");
  }
  const int64_t M = xd[0], K = xd[1];
  const int64_t L = wd.size() == 3 ? wd[0] : 1;
  const int64_t N = wd[wd.size() - 1];
  if (wd[wd.size() - 2] != K || od[0] != M || od[1] != N) {
    return ffi::Error::InvalidArgument("small_matmul_cpu: x [M, K], w [.., K, N] and out [M, N] disagree");
  }
  const int32_t layer = layer_buf.typed_data()[0];
  if (layer < 0 || layer >= L) {
    return ffi::Error::InvalidArgument("small_matmul_cpu: layer index out of range of w's first dim");
  }
  if (M == 0 || N == 0) return ffi::Error::Success();
  const float* xp = x.typed_data();
  const float* wp = w.typed_data() + int64_t(layer) * K * N;
  float* yp = out->typed_data();
  const int64_t threads = thread_count(num_threads, pool);
  // About 4 panels a thread (balance), whole 64-column tiles, at most kPanelMax columns.
  int64_t width = std::clamp<int64_t>((N + 4 * threads - 1) / (4 * threads), kTileN, kPanelMax);
  width = (width + kTileN - 1) / kTileN * kTileN;
  const int64_t total = (N + width - 1) / width;
  parallel_for(total, threads, pool, [&](int64_t i) {
    const int64_t c0 = i * width, c1 = std::min(N, c0 + width);
    panel(xp, M, K, wp, N, yp, c0, c1);
  });
  return ffi::Error::Success();
}

// One packed product of a call: W's tiles (one layer's, [T, K, 64]) and its output [M, N].
struct PackedProduct {
  const void* w;  // float, or bf16 bits (uint16_t) where bf16
  float* y;
  int64_t N, T;
  bool bf16;
};

// Products sharing x [M, K] (the first `live` rows computed, the rest zeros), each split into work
// items of whole tiles as it would be alone (about 4 a thread, at most kPanelMax columns), all
// the items handed to the pool at once. One call for a layer's q, k and v (or gate and up): one
// hand-off and one wait instead of one each, where a thread sat idle at the end of every call (a
// GQA model's k and v are 3 tiles each on SmolLM2). Measured (profile_decode's step, contexts
// 150-450, interleaved A/B on the Xeon): items sized over all the products' tiles together (6-tile
// items for gate + up) were mixed against one call each; each product's own split was faster in
// all 8 pairs at 1-40 rows, by 0.1-1.3 ms a step (1 row 24.7 / 24.3 -> 24.3 / 23.8 ms, 24 rows
// 65.3 / 65.1 -> 64.1 / 63.8).
// The split is never along K: each output is the same fma chain, whichever item computes it.
void packed_products(const float* x, int64_t M, int64_t K, int64_t live, const PackedProduct* p, int64_t count,
                     int64_t threads, ffi::ThreadPool& pool) {
  for (int64_t j = 0; j < count; ++j) std::fill(p[j].y + live * p[j].N, p[j].y + M * p[j].N, 0.f);
  if (live == 0) return;
  struct Item {
    int64_t product, t0, t1, m0, m1;
  };
  std::vector<Item> items;
  for (int64_t j = 0; j < count; ++j) {
    const int64_t tiles = std::clamp<int64_t>((p[j].T + 4 * threads - 1) / (4 * threads), 1, kPanelMax / kTileN);
    for (int64_t t0 = 0; t0 < p[j].T; t0 += tiles) items.push_back({j, t0, std::min(p[j].T, t0 + tiles), 0, live});
  }
  if (items.empty()) return;
  // Prefill (more than kGemmLoopAbove live rows: compute-bound, W from cache) with few items
  // also splits the rows, one group a thread, so every thread stays busy to the end: SmolLM2's
  // o and down are 9 tiles, 5 items, 5 : 4 tiles between two threads. Scratch harness, hot W, 2
  // threads on the Xeon, o / down ms, one group -> two: AVX2 512 rows 1.88 / 5.07-5.13 -> 1.72-1.78
  // / 4.70-4.98, 256: 0.87 / 2.38-2.41 -> 0.81-0.82 / 2.25-2.27, 192: 0.64-0.65 / 1.81-1.83 ->
  // 0.59-0.61 / 1.68, 128 and 72 within 3%, 96 mixed (o 5% slower, down 2% faster; groups of
  // 48 rows take the chunked loop); AVX-512 256 rows 0.57-0.59 / 1.53-1.59 -> 0.53-0.56 / 1.40,
  // 192: 0.42 / 1.19 -> 0.39-0.40 / 1.00-1.11, 512: 262-279 -> 289-306 GFLOP/s.
  // With 4 items a thread or more the tail is short already, and each group reads W once more
  // (gate + up's 16 items, split: 1-3% slower). Decode keeps one group: there each item
  // streams its tiles from DRAM once. Split items go longest first (tiles x rows).
  if (live > kGemmLoopAbove && int64_t(items.size()) < 4 * threads) {
    const int64_t group_rows = (live + threads - 1) / threads;
    std::vector<Item> split;
    for (int64_t m0 = 0; m0 < live; m0 += group_rows)
      for (const Item& it : items) split.push_back({it.product, it.t0, it.t1, m0, std::min(live, m0 + group_rows)});
    std::stable_sort(split.begin(), split.end(), [](const Item& a, const Item& b) {
      return (a.t1 - a.t0) * (a.m1 - a.m0) > (b.t1 - b.t0) * (b.m1 - b.m0);
    });
    items = std::move(split);
  }
  parallel_for(int64_t(items.size()), threads, pool, [&](int64_t i) {
    const Item& it = items[i];
    const PackedProduct& q = p[it.product];
    if (q.bf16) {
      packed_panel(x + it.m0 * K, it.m1 - it.m0, K, static_cast<const uint16_t*>(q.w), q.N, q.y + it.m0 * q.N,
                   it.t0, it.t1);
    } else {
      packed_panel(x + it.m0 * K, it.m1 - it.m0, K, static_cast<const float*>(q.w), q.N, q.y + it.m0 * q.N,
                   it.t0, it.t1);
    }
  });
}

// Checks one packed weight (fp32 or bf16) against x [M, K] and its output [M, N]; the layer's
// tiles or an error.
ffi::ErrorOr<PackedProduct> packed_product(int64_t M, int64_t K, const ffi::AnyBuffer& w,
                                           ffi::Result<ffi::Buffer<ffi::F32>>& out, int32_t layer, const char* what) {
  const bool bf16 = w.element_type() == ffi::DataType::BF16;
  if (!bf16 && w.element_type() != ffi::DataType::F32) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(std::string(what) + ": w must be float32 or bfloat16"));
  }
  auto wd = w.dimensions();
  auto od = out->dimensions();
  if ((wd.size() != 3 && wd.size() != 4) || od.size() != 2) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(std::string(what) +
        ": x must be [M, K], w [T, K, 64] or [L, T, K, 64], out [M, N]"));
  }
  const int64_t N = od[1];
  const int64_t L = wd.size() == 4 ? wd[0] : 1;
  const int64_t T = wd[wd.size() - 3];
  if (wd[wd.size() - 2] != K || wd[wd.size() - 1] != kTileN || od[0] != M || T != (N + kTileN - 1) / kTileN) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(std::string(what) +
        ": x [M, K], w [.., ceil(N / 64), K, 64] and out [M, N] disagree"));
  }
  if (layer < 0 || layer >= L) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(std::string(what) + ": layer index out of range of w's first dim"));
  }
  const int64_t offset = int64_t(layer) * T * K * kTileN * (bf16 ? 2 : 4);
  return PackedProduct{static_cast<const char*>(w.untyped_data()) + offset, out->typed_data(), N, T, bf16};
}

// W packed as [T, K, 64] or stacked [L, T, K, 64] (T = ceil(N / 64)); N is out's last dim.
// rows_buf: how many leading rows of x are live (a step's real tokens; the rest is bucket
// padding): only those are computed, the rows after them are zeros (clamped to [0, M]).
ffi::Error SmallMatmulPackedCpu(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> layer_buf,
                                ffi::Buffer<ffi::S32> rows_buf, ffi::ResultBuffer<ffi::F32> out, int64_t num_threads,
                                ffi::ThreadPool pool) {
  auto xd = x.dimensions();
  if (xd.size() != 2) {
    return ffi::Error::InvalidArgument(
        "small_matmul_packed_cpu: x must be [M, K], w [T, K, 64] or [L, T, K, 64], out [M, N]");
  }
  const int64_t M = xd[0], K = xd[1];
  auto product = packed_product(M, K, w, out, layer_buf.typed_data()[0], "small_matmul_packed_cpu");
  if (product.has_error()) return product.error();
  if (M == 0 || product.value().N == 0) return ffi::Error::Success();
  const int64_t live = std::clamp<int64_t>(rows_buf.typed_data()[0], 0, M);
  packed_products(x.typed_data(), M, K, live, &product.value(), 1, thread_count(num_threads, pool), pool);
  return ffi::Error::Success();
}

// Several packed weights against one x: the weights after x, layer and rows, one output each in
// the same order (every weight stacked alike, the same layer).
ffi::Error SmallMatmulPackedManyCpu(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> layer_buf,
                                    ffi::Buffer<ffi::S32> rows_buf, ffi::RemainingArgs ws, ffi::RemainingRets outs,
                                    int64_t num_threads, ffi::ThreadPool pool) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || ws.size() != outs.size() || ws.size() == 0) {
    return ffi::Error::InvalidArgument(
        "small_matmul_packed_many_cpu: x must be [M, K], and there must be one output per packed weight");
  }
  const int64_t M = xd[0], K = xd[1];
  std::vector<PackedProduct> products;
  for (size_t j = 0; j < ws.size(); ++j) {
    auto w = ws.get<ffi::AnyBuffer>(j);
    auto out = outs.get<ffi::Buffer<ffi::F32>>(j);
    if (w.has_error()) return w.error();
    if (out.has_error()) return out.error();
    auto product = packed_product(M, K, w.value(), out.value(), layer_buf.typed_data()[0],
                                  "small_matmul_packed_many_cpu");
    if (product.has_error()) return product.error();
    products.push_back(product.value());
  }
  if (M == 0) return ffi::Error::Success();
  const int64_t live = std::clamp<int64_t>(rows_buf.typed_data()[0], 0, M);
  packed_products(x.typed_data(), M, K, live, products.data(), int64_t(products.size()),
                  thread_count(num_threads, pool), pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveSmallMatmulCpu, SmallMatmulCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w [K, N] or [L, K, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer (scalar; 0 for [K, N])
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y [M, N]
                                  .Attr<int64_t>("num_threads")
                                  .Ctx<ffi::ThreadPool>());  // XLA's intra-op pool (persistent threads)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveSmallMatmulPackedCpu, SmallMatmulPackedCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::AnyBuffer>()          // w [T, K, 64] or [L, T, K, 64], f32 or bf16
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer (scalar; 0 when unstacked)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // live rows (scalar; M for all)
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y [M, N]
                                  .Attr<int64_t>("num_threads")
                                  .Ctx<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveSmallMatmulPackedManyCpu, SmallMatmulPackedManyCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer (scalar; 0 when unstacked)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // live rows (scalar; M for all)
                                  .RemainingArgs()                // the packed weights (f32 or bf16, each)
                                  .RemainingRets()                // y [M, N] for each
                                  .Attr<int64_t>("num_threads")
                                  .Ctx<ffi::ThreadPool>());

// The vector width this library was built with (16: AVX-512, 8: AVX2 + FMA, 1: scalar), for
// matmul_impl "auto", which takes the kernel only where it measured faster than XLA's dot.
extern "C" int JaxserveSmallMatmulVectorWidth() { return VEC_OR_1; }
