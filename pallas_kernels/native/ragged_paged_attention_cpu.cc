// Ragged paged attention for the CPU as an XLA FFI custom call ("cpu_native" behind sharding.ops).
//
// Same contract as pallas_kernels/ragged_paged_attention.py's ref_ragged_paged_attention (the
// per-token reference every implementation is tested against), for fp32 queries and fp32
// caches [L, P, page, K, H]: token t attends to the keys of row token_seq[t] at positions
// 0 .. positions[t] (the last `sliding_window` of them if > 0); padding (position -1) gives 0.
//
// Why it exists: on a 2-core CPU XLA runs the many small per-(row, KV head) products of
// decode and speculative verification as batched small matmuls at a fraction of the machine's
// speed, and transposes every gathered chunk first. Here each work item is one run of a
// sequence's queries (up to q_block tokens x all N query heads) over a range of its keys, read
// in place from the pages (no gather copy), 16 keys (a tile) at a time with an online softmax,
// every KV head's part of a tile in turn while the tile is in cache (one item per KV head read
// 256 of every 768 bytes of a key row, three times over):
//   scores   three query rows x four keys per pass (12 FMA chains in registers, each key
//            vector loaded once for the three rows), reduced with an hadd tree; a row left
//            over (G not a multiple of 3) takes 8 keys at a time;
//   softmax  a vectorised exp (Cody-Waite range reduction + degree-6 polynomial, ~2 ulp); no
//            rescale when the running max does not move;
//   values   acc[r, :] += p[r, c] * v[c, :] for the same three rows, accumulators in registers;
//   memory   the rows of the tile two ahead are prefetched into L2 (pages scatter them beyond
//            the hardware prefetcher), spread over the tile's compute (kPrefetchTiles).
// That is the row path (decode, short speculative runs). Blocks of at least 16 query rows per
// KV head (prefill chunks, long speculative runs) take the wide path instead (run_item_wide:
// 16 rows in a vector's lanes, no horizontal reductions; on the AVX2 build 30 layers of a
// 512-token chunk at context 700 took 106-111 ms on the row path's 153-171, as fast as the
// AVX-512 build's wide path on the same Zen 4).
// Items whose row has few queries but many keys are split along the keys (flash-decoding)
// so that one long sequence still keeps every core busy; the parts are merged at the end.
// Threads: workers on XLA's own intra-op thread pool (the FFI ThreadPool context), taking items
// from an atomic counter, longest first, the calling thread among them. Spawning a std::thread
// per call instead (as before) cost each of the model's 30 layer calls a thread start and join:
// on the loaded 2-core machine that made a whole step's attention take 1.5 to 108 ms for the
// same one-row work (the kernel's ~0.7 ms per call seen at batch 8).
// Without AVX2 + FMA (another CPU) the same loops compile as plain scalar C++.
//
// Measured on the 2-core AVX2 CI machine, 30 layers of SmolLM2-shaped attention (3 KV heads,
// 9 query heads, head dim 64, workload contexts), against the XLA path: 30 rows x 8-token
// speculative runs ~200 ms vs ~490; 48 decode rows ~100 ms vs ~210; one 512-token prefill
// chunk at context 700 ~400 ms vs ~500.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define JAXSERVE_AVX2 1
#endif

#include "build_info.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kMasked = -1e30f;  // finite, as in the reference: a fully masked tile makes no NaN
constexpr int kTile = 16;          // keys per tile (two groups of 8)
// Software prefetch of a later tile: how many tiles ahead, and the locality hint (2 =
// prefetcht1, into L2). The prefetches are spread over the tile's compute: each KV head's K
// lines before its scores, its V lines before its values. Issued all at once (384 lines for
// SmolLM2's tile) they filled the core's miss buffers and stalled it, so memory time and
// compute time added up. 30 chained layers of SmolLM2-shaped KV on the 2-core machine, GB/s
// of KV at 1 / 8 / 24 rows: whole tile at once 10.0 / 11.7 / 12.3; none 9.9 / 11.2 / 9.4;
// per head 15.0 / 17.5 / 18.1; per head, K then V 21-23 / 22-26 / 16-21 (run-to-run spread).
// Into L1 (hint 3) or 4 tiles ahead measured slower.
constexpr int kPrefetchTiles = 2;
constexpr int kPrefetchHint = 2;

struct Block {     // one run of consecutive tokens of one sequence, at most q_block long
  int32_t t0, nt;  // first flat token index, tokens
  int32_t seq;     // row of block_tables
  int32_t kbeg, kend;  // keys any of its tokens can see: [kbeg, kend)
};

struct Item {  // a block, every KV head, a range of keys; its partial softmax state goes to
  int32_t block, kbeg, kend;  // scratch rows row0 .. row0 + K x block's tokens x G (KV-head-major)
  int64_t row0, cost;
};

struct Shapes {
  int64_t T, N, H, L, P, ps, K, G, S, W;
};

#ifdef JAXSERVE_AVX2
// exp for x in [-87.3, 88.7] (inputs here are <= 0; below -87.3 the result is flushed to 0).
inline __m256 exp256(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  __m256 small = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n * ln2, ln2 split in two for precision (Cody-Waite)
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  __m256 r2 = _mm256_mul_ps(r, r);
  p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 out = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(small, out);
}

inline float hmax256(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// dot(q, k[c]) for 8 keys, as one vector [s0..s7]. H is a multiple of 8.
inline __m256 dot8(const float* q, const float* const* k, int64_t H) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t h = 0; h < H; h += 8) {
    __m256 qv = _mm256_loadu_ps(q + h);
    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[0] + h), a0);
    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[1] + h), a1);
    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[2] + h), a2);
    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[3] + h), a3);
    a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[4] + h), a4);
    a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[5] + h), a5);
    a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[6] + h), a6);
    a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[7] + h), a7);
  }
  __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// [sum(a0), sum(a1), sum(a2), sum(a3)]
inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

// Scores of three query rows against the tile's 16 keys, 4 keys at a time: 12 accumulators,
// and each key vector loaded once for the three rows (half the loads of three dot8 calls).
inline void qk3(const float* q0, const float* q1, const float* q2, const float* const* k, int64_t H,
                float* s0, float* s1, float* s2) {
  for (int kg = 0; kg < kTile; kg += 4) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00,
           a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    const float *k0 = k[kg], *k1 = k[kg + 1], *k2 = k[kg + 2], *k3 = k[kg + 3];
    for (int64_t h = 0; h < H; h += 8) {
      __m256 x0 = _mm256_loadu_ps(q0 + h), x1 = _mm256_loadu_ps(q1 + h), x2 = _mm256_loadu_ps(q2 + h);
      __m256 kv = _mm256_loadu_ps(k0 + h);
      a00 = _mm256_fmadd_ps(x0, kv, a00); a10 = _mm256_fmadd_ps(x1, kv, a10); a20 = _mm256_fmadd_ps(x2, kv, a20);
      kv = _mm256_loadu_ps(k1 + h);
      a01 = _mm256_fmadd_ps(x0, kv, a01); a11 = _mm256_fmadd_ps(x1, kv, a11); a21 = _mm256_fmadd_ps(x2, kv, a21);
      kv = _mm256_loadu_ps(k2 + h);
      a02 = _mm256_fmadd_ps(x0, kv, a02); a12 = _mm256_fmadd_ps(x1, kv, a12); a22 = _mm256_fmadd_ps(x2, kv, a22);
      kv = _mm256_loadu_ps(k3 + h);
      a03 = _mm256_fmadd_ps(x0, kv, a03); a13 = _mm256_fmadd_ps(x1, kv, a13); a23 = _mm256_fmadd_ps(x2, kv, a23);
    }
    _mm_storeu_ps(s0 + kg, reduce4(a00, a01, a02, a03));
    _mm_storeu_ps(s1 + kg, reduce4(a10, a11, a12, a13));
    _mm_storeu_ps(s2 + kg, reduce4(a20, a21, a22, a23));
  }
}
#endif

// The online softmax state of one query row, and its update with one tile of scores.
struct RowState {
  float m, l;
  float* acc;  // [H]
};

// Online-softmax step of one row over a tile of (masked) scores s[0..kTile): updates m and l,
// leaves the tile's weights in p and returns the factor the row's acc must be scaled by.
inline float softmax_tile(RowState& st, const float* s, float* p) {
#ifdef JAXSERVE_AVX2
  __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
  float m_new = std::max(st.m, hmax256(_mm256_max_ps(s0, s1)));
  __m256 mv = _mm256_set1_ps(m_new);
  __m256 p0 = exp256(_mm256_sub_ps(s0, mv)), p1 = exp256(_mm256_sub_ps(s1, mv));
  float psum = hsum256(_mm256_add_ps(p0, p1));
  _mm256_storeu_ps(p, p0);
  _mm256_storeu_ps(p + 8, p1);
#else
  float m_new = st.m;
  for (int c = 0; c < kTile; ++c) m_new = std::max(m_new, s[c]);
  float psum = 0.f;
  for (int c = 0; c < kTile; ++c) { p[c] = std::exp(s[c] - m_new); psum += p[c]; }
#endif
  // After the first tiles the running max rarely moves: then no exp and no rescale.
  float corr = m_new != st.m ? std::exp(st.m - m_new) : 1.0f;
  st.l = st.l * corr + psum;
  st.m = m_new;
  return corr;
}

#ifdef JAXSERVE_AVX2
// Head dims h0 .. h0 + 8J of R rows: acc[r] = acc[r] * corr[r] + sum_c p[r][c] * v[c]. Every
// bound is a compile-time constant so the R x J accumulators live in registers (with a
// run-time bound GCC kept them on the stack, which made this loop store-bound).
template <int R, int J>
inline void pv_chunk(float* const* acc, const float* const* p, const float* corr, const float* const* v,
                     int64_t h0) {
  __m256 a[R][J];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    __m256 cv = _mm256_set1_ps(corr[r]);
#pragma GCC unroll 16
    for (int j = 0; j < J; ++j) a[r][j] = _mm256_mul_ps(_mm256_loadu_ps(acc[r] + h0 + 8 * j), cv);
  }
  for (int c = 0; c < kTile; ++c) {
    __m256 pb[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) pb[r] = _mm256_set1_ps(p[r][c]);
    const float* vc = v[c] + h0;
#pragma GCC unroll 16
    for (int j = 0; j < J; ++j) {
      __m256 x = _mm256_loadu_ps(vc + 8 * j);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) a[r][j] = _mm256_fmadd_ps(pb[r], x, a[r][j]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int j = 0; j < J; ++j) _mm256_storeu_ps(acc[r] + h0 + 8 * j, a[r][j]);
}
#endif

// acc[r] = acc[r] * corr[r] + sum_c p[r][c] * v[c] for R rows (R <= 3) sharing the tile's values.
template <int R>
inline void pv_tile(float* const* acc, const float* const* p, const float* corr, const float* const* v, int64_t H) {
#ifdef JAXSERVE_AVX2
  constexpr int J = R == 1 ? 8 : 2;  // vectors of 8 lanes per row in registers: 3 x 4 spilled
  int64_t h0 = 0;
  for (; h0 + 8 * J <= H; h0 += 8 * J) pv_chunk<R, J>(acc, p, corr, v, h0);
  for (; h0 < H; h0 += 8) pv_chunk<R, 1>(acc, p, corr, v, h0);
#else
  for (int r = 0; r < R; ++r) {
    for (int64_t h = 0; h < H; ++h) {
      float x = acc[r][h] * corr[r];
      for (int c = 0; c < kTile; ++c) x += p[r][c] * v[c][h];
      acc[r][h] = x;
    }
  }
#endif
}

// Scores of one row against the tile's keys.
inline void qk1(const float* qi, const float* const* k, int64_t H, float* s) {
#ifdef JAXSERVE_AVX2
  _mm256_storeu_ps(s, dot8(qi, k, H));
  _mm256_storeu_ps(s + 8, dot8(qi, k + 8, H));
#else
  for (int c = 0; c < kTile; ++c) {
    float a = 0.f;
    for (int64_t h = 0; h < H; ++h) a += qi[h] * k[c][h];
    s[c] = a;
  }
#endif
}

// Offsets (in floats, layer and KV head included) of the key rows k0 .. k0 + kTile - 1 of a
// sequence; a short tile (n < kTile) repeats its last key, which the caller masks. One
// division per tile, not one per key: with the (row, tile) work small, per-key index
// arithmetic was a large part of a decode item.
inline void tile_offsets(int64_t* off, const int32_t* bt_row, const Shapes& d, int64_t layer, int64_t kvh,
                         int64_t k0, int n) {
  int64_t page_idx = k0 / d.ps, slot = k0 % d.ps;
  const int64_t base = layer * d.P;
  for (int c = 0; c < kTile; ++c) {
    int64_t idx = std::min<int64_t>(page_idx, d.W - 1);  // clamped, as XLA's gather is
    int64_t page = std::clamp<int64_t>(bt_row[idx], 0, d.P - 1);
    off[c] = (((base + page) * d.ps + slot) * d.K + kvh) * d.H;
    if (c + 1 < n && ++slot == d.ps) { slot = 0; ++page_idx; }
  }
}

// Walks item `it`'s keys a tile at a time and, within a tile, every KV head in turn, calling
// head(k0, n, kvh, kp, vp, prefetch_v): kp / vp the tile's key and value rows of that head (n of
// them real, a short tile repeating its last), prefetch_v() to ask for the tile two ahead's V
// lines of that head (once; called again after head returns, in case it did not).
// A tile's 16 keys are one page (when aligned), and every KV head's part of them is read while
// it is in cache: the item streams the K page and the V page whole (two sequential 12 KB reads
// for SmolLM2's 3 heads x 64), where one item per KV head read 256 of every 768 bytes, three
// times over at different moments, and reached a third of the machine's read bandwidth.
template <typename Head>
void for_each_tile_head(const Item& it, const Shapes& d, const int32_t* bt_row, int64_t layer, const float* kc,
                        const float* vc, Head&& head) {
  const int64_t H = d.H;
  const float* kp[kTile];
  const float* vp[kTile];
  int64_t off[kTile], next_off[kTile], pf[kTile];
  tile_offsets(next_off, bt_row, d, layer, 0, it.kbeg, int(std::min<int64_t>(kTile, it.kend - it.kbeg)));
  for (int64_t k0 = it.kbeg; k0 < it.kend; k0 += kTile) {
    const int n = int(std::min<int64_t>(kTile, it.kend - k0));
    std::memcpy(off, next_off, sizeof(off));
    if (k0 + kTile < it.kend) {
      tile_offsets(next_off, bt_row, d, layer, 0, k0 + kTile, int(std::min<int64_t>(kTile, it.kend - k0 - kTile)));
    }
    // A later tile's rows are scattered over pages, beyond the hardware prefetcher's reach:
    // ask for them while this tile computes, a KV head's K lines before its scores and its V
    // lines before its values (see kPrefetchTiles).
    const bool prefetch = k0 + kPrefetchTiles * kTile < it.kend;
    if (prefetch) {
      tile_offsets(pf, bt_row, d, layer, 0, k0 + kPrefetchTiles * kTile,
                   int(std::min<int64_t>(kTile, it.kend - k0 - kPrefetchTiles * kTile)));
    }
    auto prefetch_head = [&](const float* cache, int64_t kvh) {
      for (int c = 0; c < kTile; ++c)
        for (int64_t h = 0; h < H; h += 16) __builtin_prefetch(cache + pf[c] + kvh * H + h, 0, kPrefetchHint);
    };
    for (int64_t kvh = 0; kvh < d.K; ++kvh) {
      if (prefetch) prefetch_head(kc, kvh);
      bool v_asked = !prefetch;
      auto prefetch_v = [&]() {  // once per head, after its first scores
        if (!v_asked) prefetch_head(vc, kvh);
        v_asked = true;
      };
      for (int c = 0; c < kTile; ++c) {
        kp[c] = kc + off[c] + kvh * H;
        vp[c] = vc + off[c] + kvh * H;
      }
      head(k0, n, kvh, kp, vp, prefetch_v);
      prefetch_v();
    }
  }
}

// Whether query row i (position qpos) sees any key of the tile at k0: a row whose keys here
// are all in its future or out of its window skips the tile (its state is unchanged, exact).
inline bool row_active(int64_t qpos, int64_t k0, int64_t window) {
  return k0 <= qpos && !(window > 0 && k0 + kTile <= qpos - window + 1);
}

// One item of a block with few query rows per KV head (decode, short speculative runs): queries
// of block b, every KV head, keys [kbeg, kend); writes its rows' m, l, acc. Rows go three at a
// time against a tile (qk3, pv_tile<3>); each KV head's rows run exactly as they did in their
// own item under the earlier one-item-per-head layout, so every output is bit-identical to it.
void run_item_rows(const Item& it, const Block& b, const Shapes& d, const float* q, const float* kc,
                   const float* vc, int64_t layer, const int32_t* positions, const int32_t* bt,
                   int64_t window, float soft_cap, float scale, float* part_m, float* part_l, float* part_acc) {
  const int64_t H = d.H, G = d.G, K = d.K;
  const int64_t MG = int64_t(b.nt) * G;  // query rows of one KV head: token-major, then head
  const int64_t M = MG * K;              // KV-head-major: rows of head h are [h * MG, (h + 1) * MG)
  std::vector<float> qs(M * H);
  std::vector<int32_t> row_pos(M);
  for (int64_t kvh = 0; kvh < K; ++kvh) {
    for (int64_t j = 0; j < b.nt; ++j) {
      for (int64_t g = 0; g < G; ++g) {
        const float* src = q + ((b.t0 + j) * d.N + kvh * G + g) * H;
        const int64_t i = kvh * MG + j * G + g;
        float* dst = qs.data() + i * H;
        for (int64_t h = 0; h < H; ++h) dst[h] = src[h] * scale;
        row_pos[i] = positions[b.t0 + j];
      }
    }
  }
  std::vector<RowState> st(M);
  for (int64_t i = 0; i < M; ++i) {
    st[i].m = kMasked;
    st[i].l = 0.f;
    st[i].acc = part_acc + i * H;
    std::memset(st[i].acc, 0, sizeof(float) * H);
  }
  alignas(32) float s3[3][kTile];
  alignas(32) float p3[3][kTile];
  for_each_tile_head(it, d, bt + int64_t(b.seq) * d.W, layer, kc, vc,
                     [&](int64_t k0, int n, int64_t kvh, const float* const* kp, const float* const* vp,
                         auto& prefetch_v) {
    const int64_t base = kvh * MG;
    auto active = [&](int64_t i) { return row_active(row_pos[i], k0, window); };
    auto mask = [&](int64_t i, float* si) {
      const int64_t qpos = row_pos[i];
      // Every key of the tile visible and no cap: the common case needs no masking pass.
      if (n == kTile && k0 + kTile - 1 <= qpos && (window <= 0 || k0 > qpos - window) && soft_cap <= 0.f) return;
      for (int c = 0; c < kTile; ++c) {
        int64_t kpos = k0 + c;
        bool visible = c < n && kpos <= qpos && (window <= 0 || qpos - kpos < window);
        float sc = si[c];
        if (soft_cap > 0.f) sc = soft_cap * std::tanh(sc / soft_cap);
        si[c] = visible ? sc : kMasked;
      }
    };
    auto one_row = [&](int64_t i) {
      if (!active(i)) return;
      qk1(qs.data() + i * H, kp, H, s3[0]);
      mask(i, s3[0]);
      float corr = softmax_tile(st[i], s3[0], p3[0]);
      float* acc[1] = {st[i].acc};
      const float* pr[1] = {p3[0]};
      pv_tile<1>(acc, pr, &corr, vp, H);
    };
    int64_t i = base;
#ifdef JAXSERVE_AVX2
    for (; i + 3 <= base + MG; i += 3) {  // three rows at a time share each key and value load
      if (!(active(i) && active(i + 1) && active(i + 2))) {  // near a block's causal edge
        for (int r = 0; r < 3; ++r) one_row(i + r);
        continue;
      }
      const float* qr = qs.data() + i * H;
      qk3(qr, qr + H, qr + 2 * H, kp, H, s3[0], s3[1], s3[2]);
      prefetch_v();
      float corr[3];
      for (int r = 0; r < 3; ++r) {
        mask(i + r, s3[r]);
        corr[r] = softmax_tile(st[i + r], s3[r], p3[r]);
      }
      float* acc[3] = {st[i].acc, st[i + 1].acc, st[i + 2].acc};
      const float* pr[3] = {p3[0], p3[1], p3[2]};
      pv_tile<3>(acc, pr, corr, vp, H);
    }
#endif
    for (; i < base + MG; ++i) one_row(i);
  });
  for (int64_t i = 0; i < M; ++i) {
    part_m[i] = st[i].m;
    part_l[i] = st[i].l;
  }
}

#if defined(__AVX512F__) || defined(JAXSERVE_AVX2)
#define JAXSERVE_WIDE 1
// The wide path, for blocks with at least kLanes query rows per KV head (prefill chunks, long
// speculative runs), where the row path ran at ~30% of the FMA peak (70-80 GFLOP/s on the
// 2-core machine): its per-row horizontal reductions (scores, max, sum) and 3-row value
// blocks were most of the work. Here 16 query rows sit in the lanes of a vector (one zmm with
// AVX-512, two ymm with AVX2):
//   scores   s[c] (16 rows) = sum_h bcast(k[c][h]) * qt[h] over a tile transposed once per KV
//            head (kt[h][c], in-register transposes) and queries transposed once per item
//            (qt[h][row]): one FMA chain per key and lane, no reductions;
//   softmax  vertical: each row's max, exp and sum run lane-wise over the tile's 16 keys, the
//            state (m, l) of 16 rows in one V16 each;
//   values   acc[r, :] = acc * corr[r] + sum_c p[c][r] * v[c, :], six rows x 64 head dims in 24
//            zmm accumulators (AVX-512) or six rows x 16 head dims in 12 ymm (AVX2: 16
//            registers).
// Each row's chains (h in order per score, keys in order for m, l and acc) do not depend on
// its lane, its group or which rows the block holds beside it. Both builds do the same
// operations in the same order (the row path above is the same ymm code in both), and
// setup.py's -ffp-contract=off keeps GCC from fusing the parts' scalar merge by its -mtune: the
// AVX2 build's outputs equal the AVX-512 build's bit for bit (test_outputs_are_bit_identical_
// across_builds, in `make test-native-avx2`, which runs the kernels' tests on the AVX2 build
// whatever the machine's own).
constexpr int64_t kLanes = 16;

#ifdef __AVX512F__
// One vector of a value row's head dims, and what pv_wide does with it: a zmm.
struct WideVec {
  using T = __m512;
  static constexpr int64_t kWidth = 16;
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T a) { _mm512_storeu_ps(p, a); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
};
constexpr int kPvVectors = 4;  // value vectors per row in registers (64 head dims)

inline __m512 exp512(__m512 x) {  // exp256's steps lane for lane: the same results
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __mmask16 small = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(__mmask16(~small), _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
}

// kt[h * 16 + c] = k[c][h] for the tile's 16 key rows, h in [0, H) (H a multiple of 16): one
// 16 x 16 transpose in registers per 16 head dims (unpack pairs, then 64-bit pairs, then two
// rounds of 128-bit block shuffles).
inline void transpose_tile(const float* const* k, int64_t H, float* kt) {
  for (int64_t h0 = 0; h0 < H; h0 += 16) {
    __m512 r[16], t[16], u[16];
    for (int c = 0; c < 16; ++c) r[c] = _mm512_loadu_ps(k[c] + h0);
    for (int i = 0; i < 16; i += 2) {  // block j of t[i]: r[i][4j], r[i+1][4j], r[i][4j+1], r[i+1][4j+1]
      t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  // block j of u[i + x]: rows i .. i+3 at column 4j + x
      const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
      const __m512d c = _mm512_castps_pd(t[i + 2]), e = _mm512_castps_pd(t[i + 3]);
      u[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
      u[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
      u[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e));
      u[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
    }
    for (int x = 0; x < 4; ++x) {  // columns x, 4 + x, 8 + x, 12 + x: every row in order
      const __m512 v0 = _mm512_shuffle_f32x4(u[x], u[4 + x], 0x88), v1 = _mm512_shuffle_f32x4(u[x], u[4 + x], 0xDD);
      const __m512 v2 = _mm512_shuffle_f32x4(u[8 + x], u[12 + x], 0x88);
      const __m512 v3 = _mm512_shuffle_f32x4(u[8 + x], u[12 + x], 0xDD);
      _mm512_storeu_ps(kt + (h0 + x) * 16, _mm512_shuffle_f32x4(v0, v2, 0x88));
      _mm512_storeu_ps(kt + (h0 + 8 + x) * 16, _mm512_shuffle_f32x4(v0, v2, 0xDD));
      _mm512_storeu_ps(kt + (h0 + 4 + x) * 16, _mm512_shuffle_f32x4(v1, v3, 0x88));
      _mm512_storeu_ps(kt + (h0 + 12 + x) * 16, _mm512_shuffle_f32x4(v1, v3, 0xDD));
    }
  }
}

// out[c][lane] = sum_h qt[h * ldq + lane] * kt[h * 16 + c]: the scores of 16 query rows (lanes)
// against a transposed tile's 16 keys, h in order. The accumulators are locals indexed only by
// unrolled constants: as an array the caller indexed in loops, GCC kept them on the stack and
// stored all 16 every h (store-bound, ~45 GFLOP/s a core).
inline void scores_wide(const float* qt, int64_t ldq, const float* kt, int64_t H, float (*out)[kLanes]) {
  __m512 s[kTile];
#pragma GCC unroll 16
  for (int c = 0; c < kTile; ++c) s[c] = _mm512_setzero_ps();
  for (int64_t h = 0; h < H; ++h) {
    const __m512 qv = _mm512_loadu_ps(qt + h * ldq);
    const float* kh = kt + h * kTile;
#pragma GCC unroll 16
    for (int c = 0; c < kTile; ++c) s[c] = _mm512_fmadd_ps(_mm512_set1_ps(kh[c]), qv, s[c]);
  }
#pragma GCC unroll 16
  for (int c = 0; c < kTile; ++c) _mm512_store_ps(out[c], s[c]);
}

// 16 rows' values (one per lane) and a 16-lane mask, the softmax's vocabulary.
struct V16 { __m512 v; };
using M16 = __mmask16;
inline V16 v16_load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void v16_store(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 v16_max(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline V16 v16_sub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 v16_mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 v16_add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 v16_exp(V16 a) { return {exp512(a.v)}; }
inline V16 v16_maskz(M16 m, V16 a) { return {_mm512_maskz_mov_ps(m, a.v)}; }
inline M16 m16_all() { return 0xFFFF; }
inline M16 m16_none() { return 0; }
// Lanes whose row (at qpos[lane]) sees the key at kpos: causal, and within a window if > 0.
inline M16 m16_visible(const int32_t* qpos, int32_t kpos, int64_t window) {
  const __m512i q = _mm512_loadu_si512(qpos), k = _mm512_set1_epi32(kpos);
  M16 m = _mm512_cmple_epi32_mask(k, q);
  if (window > 0) m &= _mm512_cmplt_epi32_mask(_mm512_sub_epi32(q, k), _mm512_set1_epi32(int32_t(window)));
  return m;
}
// s where m is set, kMasked elsewhere.
inline V16 v16_masked(M16 m, V16 s) { return {_mm512_mask_blend_ps(m, _mm512_set1_ps(kMasked), s.v)}; }

#else  // AVX2 + FMA: 16 ymm registers, so smaller register blocks than AVX-512's
// One vector of a value row's head dims, and what pv_wide does with it: a ymm.
struct WideVec {
  using T = __m256;
  static constexpr int64_t kWidth = 8;
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T a) { _mm256_storeu_ps(p, a); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
};
constexpr int kPvVectors = 2;  // 6 rows x 2 accumulators + 2 value vectors + 1 broadcast = 15 ymm

// In-place 8 x 8 transpose: r[x][c] = r[c][x] (unpack pairs, 64-bit shuffles, 128-bit halves).
inline void transpose8(__m256* r) {
  __m256 t[8], s[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int x = 0; x < 4; ++x) {
    r[x] = _mm256_permute2f128_ps(s[x], s[4 + x], 0x20);
    r[4 + x] = _mm256_permute2f128_ps(s[x], s[4 + x], 0x31);
  }
}

// kt[h * 16 + c] = k[c][h] for the tile's 16 key rows, h in [0, H) (H a multiple of 8): two
// 8 x 8 transposes per 8 head dims.
inline void transpose_tile(const float* const* k, int64_t H, float* kt) {
  for (int64_t h0 = 0; h0 < H; h0 += 8) {
    for (int half = 0; half < kTile; half += 8) {
      __m256 r[8];
      for (int c = 0; c < 8; ++c) r[c] = _mm256_loadu_ps(k[half + c] + h0);
      transpose8(r);
      for (int x = 0; x < 8; ++x) _mm256_storeu_ps(kt + (h0 + x) * kTile + half, r[x]);
    }
  }
}

// out[c0 + c][lane] = sum_h qt[h * ldq + lane] * kt[h * 16 + c0 + c] for C keys: 2C
// accumulators (C <= 6 keeps them, the two query halves and a broadcast in 16 registers).
template <int C>
inline void scores_keys(const float* qt, int64_t ldq, const float* kt, int64_t H, int c0, float (*out)[kLanes]) {
  __m256 lo[C], hi[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) lo[c] = hi[c] = _mm256_setzero_ps();
  for (int64_t h = 0; h < H; ++h) {
    const __m256 q0 = _mm256_loadu_ps(qt + h * ldq), q1 = _mm256_loadu_ps(qt + h * ldq + 8);
    const float* kh = kt + h * kTile + c0;
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m256 b = _mm256_broadcast_ss(kh + c);
      lo[c] = _mm256_fmadd_ps(b, q0, lo[c]);
      hi[c] = _mm256_fmadd_ps(b, q1, hi[c]);
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) {
    _mm256_store_ps(out[c0 + c], lo[c]);
    _mm256_store_ps(out[c0 + c] + 8, hi[c]);
  }
}

// The scores of 16 query rows (lanes) against a transposed tile's 16 keys, h in order, in
// three passes of 6, 6 and 4 keys (the rows' 16 x H block of qt stays in L1 between them).
// Not inlined: inside run_item_wide GCC kept one of the 12 accumulators on the stack (a store
// and a reload every h on that chain), and 30 layers of a 512-token chunk at context 2,000 ran
// at 108 GFLOP/s; called, it allocates all 16 registers to itself: 150 (the AVX-512 build's).
__attribute__((noinline)) void scores_wide(const float* qt, int64_t ldq, const float* kt, int64_t H, float (*out)[kLanes]) {
  scores_keys<6>(qt, ldq, kt, H, 0, out);
  scores_keys<6>(qt, ldq, kt, H, 6, out);
  scores_keys<4>(qt, ldq, kt, H, 12, out);
}

// 16 rows' values as two halves of 8 lanes; a mask as all-ones / all-zeros lanes.
struct V16 { __m256 lo, hi; };
struct M16 { __m256 lo, hi; };
inline V16 v16_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void v16_store(float* p, V16 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
inline V16 v16_max(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 v16_sub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 v16_mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 v16_add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 v16_exp(V16 a) { return {exp256(a.lo), exp256(a.hi)}; }  // exp512's results lane for lane
inline V16 v16_maskz(M16 m, V16 a) { return {_mm256_and_ps(m.lo, a.lo), _mm256_and_ps(m.hi, a.hi)}; }
inline M16 m16_all() {
  const __m256 ones = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  return {ones, ones};
}
inline M16 m16_none() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
// Lanes whose row (at qpos[lane]) sees the key at kpos: causal, and within a window if > 0.
inline __m256i visible8(const int32_t* qpos, int32_t kpos, int64_t window) {
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qpos)), k = _mm256_set1_epi32(kpos);
  __m256i m = _mm256_andnot_si256(_mm256_cmpgt_epi32(k, q), _mm256_set1_epi32(-1));  // kpos <= qpos
  if (window > 0) m = _mm256_and_si256(m, _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(window)), _mm256_sub_epi32(q, k)));
  return m;
}
inline M16 m16_visible(const int32_t* qpos, int32_t kpos, int64_t window) {
  return {_mm256_castsi256_ps(visible8(qpos, kpos, window)), _mm256_castsi256_ps(visible8(qpos + 8, kpos, window))};
}
// s where m is set, kMasked elsewhere.
inline V16 v16_masked(M16 m, V16 s) {
  const __m256 masked = _mm256_set1_ps(kMasked);
  return {_mm256_blendv_ps(masked, s.lo, m.lo), _mm256_blendv_ps(masked, s.hi, m.hi)};
}
#endif

constexpr int64_t kWideDims = WideVec::kWidth;  // head dims one vector of a key or value row holds

// acc[r, h0 .. h0 + J vectors) = acc * corr[r] + sum_c p[c * ldp + r] * v[c][h0 ..] for R rows
// (compile-time bounds keep the R x J accumulators in registers).
template <int R, int J>
inline void pv_wide(float* acc, int64_t H, const float* p, int64_t ldp, const float* corr, const float* const* v,
                    int64_t h0) {
  using V = WideVec;
  typename V::T a[R][J];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const typename V::T cv = V::set1(corr[r]);
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) a[r][j] = V::mul(V::load(acc + r * H + h0 + V::kWidth * j), cv);
  }
  for (int c = 0; c < kTile; ++c) {
    typename V::T x[J];
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) x[j] = V::load(v[c] + h0 + V::kWidth * j);
    const float* pc = p + c * ldp;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const typename V::T pb = V::set1(pc[r]);
#pragma GCC unroll 8
      for (int j = 0; j < J; ++j) a[r][j] = V::fmadd(pb, x[j], a[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) V::store(acc + r * H + h0 + V::kWidth * j, a[r][j]);
}

// pv_wide over R (1 .. 6) rows and every head dim: kPvVectors vectors at a time, then one.
template <int R>
inline void pv_wide_rows(float* acc, int64_t H, const float* p, int64_t ldp, const float* corr,
                         const float* const* v) {
  int64_t h0 = 0;
  for (; h0 + kPvVectors * kWideDims <= H; h0 += kPvVectors * kWideDims) {
    pv_wide<R, kPvVectors>(acc, H, p, ldp, corr, v, h0);
  }
  for (; h0 < H; h0 += kWideDims) pv_wide<R, 1>(acc, H, p, ldp, corr, v, h0);
}

inline void pv_wide_any(int64_t R, float* acc, int64_t H, const float* p, int64_t ldp, const float* corr,
                        const float* const* v) {
  switch (R) {
    case 6: pv_wide_rows<6>(acc, H, p, ldp, corr, v); break;
    case 5: pv_wide_rows<5>(acc, H, p, ldp, corr, v); break;
    case 4: pv_wide_rows<4>(acc, H, p, ldp, corr, v); break;
    case 3: pv_wide_rows<3>(acc, H, p, ldp, corr, v); break;
    case 2: pv_wide_rows<2>(acc, H, p, ldp, corr, v); break;
    default: pv_wide_rows<1>(acc, H, p, ldp, corr, v); break;
  }
}

// One item of a wide block (see above); same outputs as run_item_rows up to rounding.
void run_item_wide(const Item& it, const Block& b, const Shapes& d, const float* q, const float* kc,
                   const float* vc, int64_t layer, const int32_t* positions, const int32_t* bt,
                   int64_t window, float soft_cap, float scale, float* part_m, float* part_l, float* part_acc) {
  const int64_t H = d.H, G = d.G, K = d.K;
  const int64_t MG = int64_t(b.nt) * G;                  // rows of one KV head, token-major
  const int64_t MGp = (MG + kLanes - 1) / kLanes * kLanes;  // padded to whole vectors
  std::vector<float> qt(K * H * MGp, 0.f);  // [K][H][MGp]: row i of head kvh at qt[(kvh H + h) MGp + i]
  std::vector<int32_t> row_pos(MGp, -1);    // padding lanes see no key (-1 < every key position)
  for (int64_t kvh = 0; kvh < K; ++kvh)
    for (int64_t j = 0; j < b.nt; ++j)
      for (int64_t g = 0; g < G; ++g) {
        const float* src = q + ((b.t0 + j) * d.N + kvh * G + g) * H;
        float* dst = qt.data() + kvh * H * MGp + j * G + g;
        for (int64_t h = 0; h < H; ++h) dst[h * MGp] = src[h] * scale;
      }
  for (int64_t i = 0; i < MG; ++i) row_pos[i] = positions[b.t0 + i / G];
  std::vector<float> mv(K * MGp, kMasked), lv(K * MGp, 0.f);
  std::memset(part_acc, 0, sizeof(float) * K * MG * H);
  std::vector<float> pall(kTile * MGp), call(MGp), kt(H * kTile);
  alignas(64) float sbuf[kTile][kLanes];
  for_each_tile_head(it, d, bt + int64_t(b.seq) * d.W, layer, kc, vc,
                     [&](int64_t k0, int n, int64_t kvh, const float* const* kp, const float* const* vp,
                         auto& prefetch_v) {
    // Rows ascend in position, so the rows that see this tile are one range [ra, rb).
    int64_t ra = 0, rb = MG;
    while (ra < MG && !row_active(row_pos[ra], k0, window)) ++ra;
    while (rb > ra && !row_active(row_pos[rb - 1], k0, window)) --rb;
    if (ra == rb) return;
    transpose_tile(kp, H, kt.data());
    const float* qh = qt.data() + kvh * H * MGp;
    float* mh = mv.data() + kvh * MGp;
    float* lh = lv.data() + kvh * MGp;
    for (int64_t g0 = ra / kLanes * kLanes; g0 < rb; g0 += kLanes) {
      scores_wide(qh + g0, MGp, kt.data(), H, sbuf);
      // Every lane a real row seeing every key, no cap: the common case needs no masks.
      const int64_t last = std::min(g0 + kLanes, MG) - 1;
      const bool all_visible = g0 + kLanes <= MG && n == kTile && k0 + kTile - 1 <= row_pos[g0] &&
                               (window <= 0 || k0 > row_pos[last] - window) && soft_cap <= 0.f;
      M16 vis[kTile];
      if (all_visible) {
        for (int c = 0; c < kTile; ++c) vis[c] = m16_all();
      } else {
        if (soft_cap > 0.f) {
          for (int c = 0; c < kTile; ++c)
            for (int r = 0; r < kLanes; ++r) sbuf[c][r] = soft_cap * std::tanh(sbuf[c][r] / soft_cap);
        }
        for (int c = 0; c < kTile; ++c) {
          vis[c] = c < n ? m16_visible(row_pos.data() + g0, int32_t(k0 + c), window) : m16_none();
          v16_store(sbuf[c], v16_masked(vis[c], v16_load(sbuf[c])));
        }
      }
      const V16 m_old = v16_load(mh + g0);
      V16 m_new = m_old;
#pragma GCC unroll 16
      for (int c = 0; c < kTile; ++c) m_new = v16_max(m_new, v16_load(sbuf[c]));
      const V16 corr = v16_exp(v16_sub(m_old, m_new));  // exactly 1 where the max held
      V16 l = v16_mul(v16_load(lh + g0), corr);
      for (int c = 0; c < kTile; ++c) {
        // masked keys weigh exactly 0 (a row that has seen no key yet has m = kMasked too)
        const V16 p = v16_maskz(vis[c], v16_exp(v16_sub(v16_load(sbuf[c]), m_new)));
        l = v16_add(l, p);
        v16_store(pall.data() + c * MGp + g0, p);
      }
      v16_store(lh + g0, l);
      v16_store(mh + g0, m_new);
      v16_store(call.data() + g0, corr);
    }
    prefetch_v();
    float* acc = part_acc + kvh * MG * H;
    for (int64_t r = ra; r < rb; r += 6) {
      pv_wide_any(std::min<int64_t>(6, rb - r), acc + r * H, H, pall.data() + r, MGp, call.data() + r, vp);
    }
  });
  for (int64_t kvh = 0; kvh < K; ++kvh)
    for (int64_t i = 0; i < MG; ++i) {
      part_m[kvh * MG + i] = mv[kvh * MGp + i];
      part_l[kvh * MG + i] = lv[kvh * MGp + i];
    }
}
#endif

// One item, by the path its block's width takes.
void run_item(const Item& it, const Block& b, const Shapes& d, const float* q, const float* kc, const float* vc,
              int64_t layer, const int32_t* positions, const int32_t* bt, int64_t window, float soft_cap,
              float scale, float* part_m, float* part_l, float* part_acc) {
#ifdef JAXSERVE_WIDE
  if (d.H % kWideDims == 0 && int64_t(b.nt) * d.G >= kLanes) {
    run_item_wide(it, b, d, q, kc, vc, layer, positions, bt, window, soft_cap, scale, part_m, part_l, part_acc);
    return;
  }
#endif
  run_item_rows(it, b, d, q, kc, vc, layer, positions, bt, window, soft_cap, scale, part_m, part_l, part_acc);
}

ffi::Error RaggedPagedAttentionCpu(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                                   ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> layer_buf,
                                   ffi::Buffer<ffi::S32> positions_buf, ffi::Buffer<ffi::S32> token_seq_buf,
                                   ffi::Buffer<ffi::S32> block_tables_buf, ffi::ResultBuffer<ffi::F32> out,
                                   int64_t sliding_window, float soft_cap, int64_t q_block,
                                   int64_t num_threads, ffi::ThreadPool pool) {
  auto qd = q.dimensions();
  auto cd = k_cache.dimensions();
  auto bd = block_tables_buf.dimensions();
  if (qd.size() != 3 || (cd.size() != 4 && cd.size() != 5) || bd.size() != 2 || qd[2] < 1) {
    return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: q must be [T, N, H], caches [L, P, page, K * H] "
                                       "or [L, P, page, K, H], block_tables [S, pages]");
  }
  // The engine stores the cache [L, P, page, K * H] (the TPU kernel's layout); in memory that is
  // [L, P, page, K, H], so K comes from the last dim. Reading it as stored matters: a reshape to
  // 5-D before the call made XLA copy the whole donated cache on every layer's call.
  const int64_t K = cd.size() == 5 ? cd[3] : cd[3] / qd[2];
  const int64_t cache_h = cd.size() == 5 ? cd[4] : (cd[3] % qd[2] == 0 ? qd[2] : -1);
  Shapes d{qd[0], qd[1], qd[2], cd[0], cd[1], cd[2], K, K > 0 ? qd[1] / K : 0, bd[0], bd[1]};
  if (K < 1 || cache_h != d.H || d.N % d.K != 0 || d.H % 8 != 0 || q_block < 1) {
    return ffi::Error::InvalidArgument("ragged_paged_attention_cpu: head dims differ, query heads not a multiple of "
                                       "KV heads, head dim not a multiple of 8, or q_block < 1");
  }
  const float* qp = q.typed_data();
  const float* kc = k_cache.typed_data();
  const float* vc = v_cache.typed_data();
  const int32_t* positions = positions_buf.typed_data();
  const int32_t* token_seq = token_seq_buf.typed_data();
  const int32_t* bt = block_tables_buf.typed_data();
  const int64_t layer = std::clamp<int64_t>(layer_buf.typed_data()[0], 0, d.L - 1);
  float* op = out->typed_data();
  std::memset(op, 0, sizeof(float) * d.T * d.N * d.H);  // padding tokens come out as zeros

  // Runs of consecutive tokens of one sequence, cut into blocks of q_block tokens.
  std::vector<Block> blocks;
  for (int64_t t = 0; t < d.T;) {
    if (positions[t] < 0) { ++t; continue; }
    int64_t e = t + 1;
    while (e < d.T && e - t < q_block && token_seq[e] == token_seq[t] && positions[e] == positions[e - 1] + 1) ++e;
    Block b{int32_t(t), int32_t(e - t), std::clamp<int32_t>(token_seq[t], 0, int32_t(d.S - 1)), 0, 0};
    b.kend = positions[e - 1] + 1;  // positions rise by one along the run: its ends bound it
    b.kbeg = sliding_window > 0 ? int32_t(std::max<int64_t>(0, positions[t] - sliding_window + 1)) : 0;
    b.kbeg -= b.kbeg % kTile;  // tiles start on multiples of kTile
    blocks.push_back(b);
    t = e;
  }

  // Items: blocks (every KV head), split along keys into parts of at most kSplitKeys; the parts
  // of one block are consecutive in `items`, which the merge relies on. The split depends
  // only on the block's own key range, never on its batch mates or the machine's thread count
  // (an earlier rule split by a fair share of the step's total work): a row's rounding, and so
  // its greedy tokens and logprobs, are the same whatever else runs in the step and on any
  // machine, as the XLA path's are (tests/test_ragged_paged_attention_cpu.py checks it).
  // kSplitKeys: long enough that a part's merge (one max, one rescale per query row) is
  // negligible against its 512 keys x head dim FMAs, short enough that one long decode row
  // still spreads over every core.
  constexpr int64_t kSplitKeys = 512;
  static_assert(kSplitKeys % kTile == 0, "parts start on tile boundaries");
  std::vector<Item> items;
  int64_t rows_total = 0;  // scratch rows (m, l, acc) of every part
  for (int32_t bi = 0; bi < int32_t(blocks.size()); ++bi) {
    const Block& b = blocks[bi];
    const int64_t per = kSplitKeys;
    for (int64_t k0 = b.kbeg; k0 < b.kend; k0 += per) {
      int64_t k1 = std::min<int64_t>(b.kend, k0 + per);
      items.push_back(Item{bi, int32_t(k0), int32_t(k1), rows_total, int64_t(b.nt) * (k1 - k0)});
      rows_total += int64_t(b.nt) * d.G * d.K;
    }
  }
  std::vector<float> pm(rows_total), pl(rows_total), pacc(rows_total * d.H);
  std::vector<int32_t> order(items.size());
  for (size_t i = 0; i < items.size(); ++i) order[i] = int32_t(i);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return items[a].cost > items[b].cost; });

  const float scale = 1.0f / std::sqrt(float(d.H));
  // The counters live in a shared_ptr held by every scheduled task: a task the pool starts
  // after the work is done only reads `next` (past the end) and returns, so it must not touch
  // this frame. An item is only claimed while next < total, i.e. before this call can return.
  struct Counters {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto counters = std::make_shared<Counters>();
  const int64_t total_items = int64_t(order.size());
  auto run = [&](int64_t n) {
    const Item& it = items[order[n]];
    run_item(it, blocks[it.block], d, qp, kc, vc, layer, positions, bt, sliding_window, soft_cap, scale,
             pm.data() + it.row0, pl.data() + it.row0, pacc.data() + it.row0 * d.H);
  };
  std::function<void(int64_t)> run_fn = run;
  auto work = [counters, total_items, fn = &run_fn]() {
    for (int64_t n; (n = counters->next.fetch_add(1)) < total_items;) {
      (*fn)(n);
      counters->done.fetch_add(1, std::memory_order_release);
    }
  };
  int64_t threads = num_threads > 0 ? num_threads : pool.num_threads();
  if (threads < 1) threads = std::max(1u, std::thread::hardware_concurrency());
  int64_t helpers = std::min<int64_t>(threads, total_items) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));  // a copy per task
  work();  // the calling thread works too: nothing waits on a pool thread that never starts
  while (counters->done.load(std::memory_order_acquire) < total_items) std::this_thread::yield();

  // Merge each block's parts, items [first, end), and write the normalised rows out.
  for (size_t first = 0, end; first < items.size(); first = end) {
    for (end = first + 1; end < items.size() && items[end].block == items[first].block; ++end) {}
    const Block& b = blocks[items[first].block];
    const int64_t MG = int64_t(b.nt) * d.G;
    for (int64_t hi = 0; hi < MG * d.K; ++hi) {
      const int64_t h = hi / MG, i = hi % MG;
      float m = kMasked;
      for (size_t p = first; p < end; ++p) m = std::max(m, pm[items[p].row0 + hi]);
      float l = 0.f;
      float* dst = op + ((b.t0 + i / d.G) * d.N + h * d.G + i % d.G) * d.H;
      for (size_t p = first; p < end; ++p) {
        int64_t r = items[p].row0 + hi;
        float w = std::exp(pm[r] - m);
        l += pl[r] * w;
        const float* a = pacc.data() + r * d.H;
        for (int64_t x = 0; x < d.H; ++x) dst[x] += a[x] * w;
      }
      float inv = 1.0f / std::max(l, 1e-30f);
      for (int64_t x = 0; x < d.H; ++x) dst[x] *= inv;
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRaggedPagedAttentionCpu, RaggedPagedAttentionCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [T, N, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_cache [L, P, page, K * H] or [.., K, H]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer (scalar)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // positions [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // token_seq [T]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables [S, pages]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [T, N, H]
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("q_block")
                                  .Attr<int64_t>("num_threads")
                                  .Ctx<ffi::ThreadPool>());  // XLA's intra-op pool (persistent threads)
