// sluice's whole-model step for short chunks (decode, speculative verification) on the CPU.
//
// Why: a small model's eager decode step is ~500 ATen calls whose fixed costs (dispatch, allocation,
// thread pool wake-ups) outweigh the arithmetic; the bundled 6.8 M-parameter model spent 13 ms per
// token there. This file runs the whole forward (embedding, blocks with GQA attention over the KV cache
// and an MLP, final norm, LM head) in ONE OpenMP parallel region: each phase is an
// `omp for` over output rows, phases are separated by barriers. It reads the model's own weight
// tensors in place (fp32, bf16, int8 codes whose sums are scaled per row once complete, or int4 codes in groups
// (q4.h); widened in registers, fp32 accumulation), writes the new keys and
// values into the engine's cache tensors exactly where layers.py writes them, and returns fp32
// logits (or final-normed hidden states). fast_step.py decides which models may take this path.
//
// Every family runs this one code: where they differ (RMSNorm or LayerNorm, where the norms sit, qk-norm
// per head or over the whole width, soft-caps, embedding scale, learned positions or one or two RoPE
// tables, parallel residual, the MLP's gate and activation, biases) is a flag or an absent tensor of Step,
// never a family name. A pre-norm RMSNorm model (Llama, Qwen) takes exactly the arithmetic it took before
// the other families came: each addition is a branch on one of those flags, off for it.
//
// The cache is either the static one, (L, B, K, S, D), or a paged pool (L, NB, K, bs, D) read through
// a block table (B, nb) for the continuous-batching scheduler: slot s of row b lives in block
// table[b][s / bs] at offset s % bs. The static cache is the pool whose blocks are whole rows (bs = S,
// table[b] = {b}), so one code path serves both and the two agree bit for bit.
//
// SIMD: built with -march=native, so the code paths are chosen at compile time by what the CPU has. With
// AVX-512 the products run in register tiles of 4 weight rows x 4 token rows (one weight load serves 4
// rows: batched decode costs ~1.7 single-row steps, not ~3), in passes that keep a few weight rows in L1
// while all token rows run over them (prefill chunks), and attention runs 16 lanes wide; with only
// AVX2 + FMA, the 8-lane loops below; without either, plain loops. A row's result does not depend on the
// other rows of its batch on the AVX-512 path (every tile shape sums in the same order).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <new>
#ifdef __linux__
#include <sys/mman.h>
#endif
#include <iterator>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

using namespace sluice_simd;
using bf16 = at::BFloat16;

// out[r][m] = dot(w[r][0:K], x row m) for N weight rows x M activation rows (N <= 4, M <= 6, N * M <= 12): each
// loaded weight vector serves M rows and each activation vector N weight rows. Every (r, m) sums in one order
// whatever N and M are (8 lanes over k, then hsum, then the K % 8 tail), so a token's numbers do not
// depend on how many rows share its call: decode alone (N = 4, M = 1: four independent chains keep
// loads in flight) and in a batch or a prefill chunk (N = 2, M <= 6) give the same bits.
// pf (Pf > 0): the next weight rows, Pf lines of them prefetched per step of 8 k (into L2 when far), so decode's
// stream of rows does not wait for each new group's first lines; it changes no number.
template <typename W, int N, int M, int Pf = 0>
inline void dot_NxM(const W* const w[N], const float* x, int64_t ldx, int64_t K, float out[4][6],
                    const char* pf = nullptr, bool far = false) {
  int64_t k = 0;
#ifdef SLUICE_AVX2
  __m256 a[N][M];
  for (int r = 0; r < N; ++r)
    for (int m = 0; m < M; ++m) a[r][m] = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    if constexpr (Pf > 0) {
      if (pf) {
        if (far)
          for (int j = 0; j < Pf; ++j) _mm_prefetch(pf + 64 * j, _MM_HINT_T1);
        else
          for (int j = 0; j < Pf; ++j) _mm_prefetch(pf + 64 * j, _MM_HINT_T0);
        pf += 64 * Pf;
      }
    }
    __m256 u[N];
    for (int r = 0; r < N; ++r) u[r] = load8(w[r] + k);
    for (int m = 0; m < M; ++m) {
      __m256 xm = _mm256_loadu_ps(x + m * ldx + k);
      for (int r = 0; r < N; ++r) a[r][m] = _mm256_fmadd_ps(u[r], xm, a[r][m]);
    }
  }
  for (int r = 0; r < N; ++r)
    for (int m = 0; m < M; ++m) out[r][m] = hsum(a[r][m]);
#else
  for (int r = 0; r < N; ++r)
    for (int m = 0; m < M; ++m) out[r][m] = 0.f;
#endif
  // The K % 8 tail as explicit FMAs: GCC compiles C++ with -ffp-contract=fast, and contracted a plain `+= w * x`
  // into an FMA in some of this template's instances and not in others (2 x 4 and 2 x 5 tiles gave other bits
  // than 2 x 6 at K = 44 until this was written out).
  for (; k < K; ++k)
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < N; ++r) out[r][m] = std::fma(widen(w[r][k]), x[m * ldx + k], out[r][m]);
}

#ifdef SLUICE_AVX512
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const int8_t* p) {  // int8 codes, exact in fp32
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// The 16 horizontal sums of v[0..15] in one vector, lane i = sum of v[i]: a tree of 15 shuffle-and-add
// steps (halves, quarters, pairs, singles) instead of 16 separate reductions of ~8 steps each. Every lane's
// sum takes the same path through the tree, so a sum's bits do not depend on its place in v. Always inlined:
// as a call, it takes v by address, and the compiler then kept a caller's 16 accumulators in memory, a store
// after every FMA of attention's score loop (attention ran ~25% slower on a Zen 5).
__attribute__((always_inline)) inline __m512 reduce16(const __m512 v[16]) {
  __m512 p[8], r[4], t[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: v[2i]'s 256-bit halves added, lanes 8-15: v[2i+1]'s
    p[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // 128-bit quarter j: v[4i + j]'s four partial sums
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i) {  // quarter j: two partials of v[8i + j], then two of v[8i + 4 + j]
    const __m512d a = _mm512_castps_pd(r[2 * i]), b = _mm512_castps_pd(r[2 * i + 1]);
    t[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // lane 4j + e: the sum of v[4e + j]; the permutation puts it at lane 4e + j.
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), s);
}

// The sums dot(w[r][0:K], x row m) for R weight rows x MT activation rows (R * MT <= 16), returned in
// one vector at lane m * R + r: a row's R sums lie side by side, so they store as one piece. The R * MT
// accumulators stay in registers, each weight vector serves MT rows and each activation vector R rows
// (R + MT loads per R * MT FMAs), and one reduce16 finishes all the sums.
// pf: lines of weights a later tile will read, prefetched a few per step of 16 k while these are summed, so the
// weights stream from memory (L3 here) at a steady rate instead of stalling at the start of a tile.


// A stream of 64-byte lines [p, end) to prefetch, per_step lines at each step of a tile's k loop.
struct Prefetch {
  const char* p = nullptr;
  const char* end = nullptr;
  int64_t per_step = 0;
  bool far = false;  // the weights stream from DRAM: the Pf lines go to L2 (see Linear::far)
};

// A tile's sums: reduce16 of its accumulators a, then the products k..K-1 (the K % 16 tail), one FMA each in order.
template <typename W, int R, int MT>
inline __m512 reduce_tail(const __m512 a[16], const W* const w[R], const float* x, int64_t ldx, int64_t k, int64_t K) {
  __m512 s = reduce16(a);
  if (k < K) {
    alignas(64) float out[16];
    _mm512_store_ps(out, s);
    for (; k < K; ++k)
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < MT; ++m) out[m * R + r] = std::fma(widen(w[r][k]), x[m * ldx + k], out[m * R + r]);
    s = _mm512_load_ps(out);
  }
  return s;
}

// One step of a tile's prefetch stream: Pf > 0, exactly Pf lines from pp (unless null), into L1 or, for weights
// streaming from DRAM (far), L2; Pf = 0, up to per_step lines before pend, into L2 only (see block()'s M > 1
// comment). tile() and b16.h's tiles take one step per 16 k.
template <int Pf>
inline void prefetch_step(const char*& pp, const char* pend, bool far, int64_t per_step) {
  if constexpr (Pf > 0) {
    if (pp) {
      if (far)
        for (int j = 0; j < Pf; ++j) _mm_prefetch(pp + 64 * j, _MM_HINT_T1);
      else
        for (int j = 0; j < Pf; ++j) _mm_prefetch(pp + 64 * j, _MM_HINT_T0);
      pp += 64 * Pf;
    }
  } else {
    for (int64_t j = 0; j < per_step && pp < pend; ++j, pp += 64) _mm_prefetch(pp, _MM_HINT_T1);
  }
}

// Every sum's arithmetic is the same whatever the tile shape or the batch (the engine relies on a token's
// numbers not depending on which chunk or batch it ran in): 16 lanes of FMAs over ascending k, reduce16's
// tree, then the K % 16 last products, one FMA each. (Before 2026-12-01 that tail was a plain loop whose
// products GCC fused at some tile shapes and not at others, so with K % 16 != 0 a token's last bits
// depended on how many rows shared its call.)
//
// Pf > 0: exactly Pf lines per step from pf.p (unless null), unrolled and unchecked: decode's tiles, whose
// stream is exactly the next rows' K / 16 * Pf lines.
template <typename W, int R, int MT, int Pf = 0>
inline __m512 tile(const W* const w[R], const float* x, int64_t ldx, int64_t K, Prefetch& pf) {
  static_assert(R * MT <= 16, "one reduce16 per tile");
  const char *pp = pf.p, *const pend = pf.end;  // in registers while the loop runs
  const bool far = pf.far;
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    prefetch_step<Pf>(pp, pend, far, pf.per_step);
    __m512 xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = _mm512_loadu_ps(x + m * ldx + k);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = load16(w[r] + k);
      for (int m = 0; m < MT; ++m) a[m * R + r] = _mm512_fmadd_ps(wv, xv[m], a[m * R + r]);
    }
  }
  pf.p = pp;
  return reduce_tail<W, R, MT>(a, w, x, ldx, k, K);
}

// Decode's (M = 1) prefetch of the next 16 weight rows: the line of row r at byte offset off is fetched when this
// group's row r reaches off, so the stream runs one group ahead in the order the rows are read (into L2 when far,
// as Prefetch). rows: how many of the next group's rows exist (0: none, p may be null); at most 16 are assumed of
// another matrix's rows (block()'s `after`), so the addresses are reckoned as integers: one past that matrix's end is
// only ever prefetched (which cannot fault), never formed as a pointer.
struct RowStream {
  const char* p = nullptr;
  int64_t row_bytes = 0, rows = 0;
  bool far = false;
  inline void line(int r, int64_t off) const {
    if (r < rows) {
      const void* a = reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(p) + r * row_bytes + off);
      if (far) _mm_prefetch(static_cast<const char*>(a), _MM_HINT_T1);
      else _mm_prefetch(static_cast<const char*>(a), _MM_HINT_T0);
    }
  }
};

// tile<W, 16, 1>'s sums, the same bits (each row's accumulator takes the same FMAs in the same order), with the
// 16 rows read one after the other instead of side by side: each row a single stream through its K weights. A
// Zen 5 read the Qwen3-0.6B shape's decode weights ~1.25x faster so (bf16 dot mode; fp32 ~1.1x) than as 16
// interleaved streams 2 KB apart (bench/decode_order.py, which alternates the two in one process; docs/
// changelog-benchmarks.md, "2026-12-04 (night)"). b16.h's tile_rows_b16 and tile_rows_dp are its bf16 twins.
template <typename W>
inline __m512 tile_rows(const W* const w[16], const float* x, int64_t K, const RowStream& pf) {
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
  const int64_t K16 = K / 16 * 16;
  for (int r = 0; r < 16; ++r)
    for (int64_t k = 0; k < K16; k += 16) {
      const int64_t off = k * static_cast<int64_t>(sizeof(W));
      if (off % 64 == 0) pf.line(r, off);
      a[r] = _mm512_fmadd_ps(load16(w[r] + k), _mm512_loadu_ps(x + k), a[r]);
    }
  return reduce_tail<W, 16, 1>(a, w, x, K, K16, K);
}

// e^x in 16 lanes: x = n ln2 + r with |r| <= ln2 / 2, Cephes' expf polynomial in r, then 2^n by scalef
// (which also underflows to 0 correctly). Within 1.3 ulp of the exact e^x over [-87, 88] (1.3 M points
// checked against double exp); inputs past 88.7 clamp there, so no inf reaches a division.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-103.f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln2 in two parts: n * hi is exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 q = _mm512_set1_ps(1.9875691500e-4f);
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.3981999507e-3f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(8.3334519073e-3f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(4.1665795894e-2f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.6666665459e-1f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(5.0000001201e-1f));
  q = _mm512_fmadd_ps(_mm512_mul_ps(q, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(q, n);
}
inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

// tanh in 16 lanes as 1 - 2 / (e^2x + 1), with exp16 (which clamps, so the ends come out as +-1 exactly).
// Within ~1e-7 of std::tanh absolutely; near 0, where tanh(x) ~ x, that is not a relative bound, which is
// fine where it is used: a soft-cap multiplies it by the cap (scores and logits, then a softmax), GELU by x.
inline __m512 tanh16(__m512 x) {
  const __m512 e = exp16(_mm512_add_ps(x, x)), one = _mm512_set1_ps(1.f);
  return _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one)));
}
#endif

#if defined(SLUICE_AVX2) && !defined(SLUICE_AVX512)
// exp16's arithmetic in 8 lanes, for a CPU without AVX-512: the same clamp, rounding and polynomial, and 2^n as
// two exact powers of two (n / 2 and the rest, each a normal float), so the one rounding of a result that
// underflows is scalef's: the same bits as exp16 for every input.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-103.f)), _mm256_set1_ps(88.7f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 q = _mm256_set1_ps(1.9875691500e-4f);
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.3981999507e-3f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(8.3334519073e-3f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(4.1665795894e-2f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(1.6666665459e-1f));
  q = _mm256_fmadd_ps(q, r, _mm256_set1_ps(5.0000001201e-1f));
  q = _mm256_fmadd_ps(_mm256_mul_ps(q, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1), rest = _mm256_sub_epi32(ni, half);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(q, p1), p2);
}
// Lanes [0, n) on (all of them for n >= 8): a mask for maskload / maskstore.
inline __m256i first_lanes8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
// The 8 horizontal sums of v[0..7] in one vector, lane i = the sum of v[i] (pairs, then quads, then halves; the
// same path for every lane). Always inlined, as reduce16 is.
__attribute__((always_inline)) inline __m256 reduce8(const __m256 v[8]) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
// tanh16's formula in 8 lanes, with exp8: the same bits as tanh16.
inline __m256 tanh8(__m256 x) {
  const __m256 e = exp8(_mm256_add_ps(x, x)), one = _mm256_set1_ps(1.f);
  return _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, one)));
}
#endif

// out[i] = silu(g[i]) * u[i] = g / (1 + e^-g) * u for i < n, as F.silu(gate) * up.
inline void silu_mul(const float* g, const float* u, int64_t n, float* out) {
  int64_t i = 0;
#ifdef SLUICE_AVX512
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = _mm512_loadu_ps(g + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e)),
                                            _mm512_loadu_ps(u + i)));
  }
#elif defined(SLUICE_AVX2)
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), e)),
                                            _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

// The MLP's activation, as fast_step.py names it from the model's: SiLU, GELU (erf), GELU's tanh form.
enum Act : int64_t { kSilu = 0, kGelu = 1, kGeluTanh = 2 };

// act(g) in fp32 as layers.py applies it: torch's exact GELU is x / 2 (1 + erf(x / sqrt 2)); GPT-2's
// gelu_new and torch's fused "tanh" GELU are one formula, which in fp32 differ by an ulp at most.
inline float activate(int64_t act, float g) {
  if (act == kGelu) return 0.5f * g * (1.f + std::erf(g * 0.70710678118654752f));
  if (act == kGeluTanh) return 0.5f * g * (1.f + std::tanh(0.79788456080286536f * (g + 0.044715f * g * g * g)));
  return g / (1.f + std::exp(-g));
}

// cap * tanh(s / cap), Gemma 2's soft-cap on attention scores and on logits, in the order torch computes it.
inline float soft_cap(float s, float cap) { return std::tanh(s / cap) * cap; }

// soft_cap over s[0:n] in place, 16 lanes at a time where it can. Which form a value takes depends only on
// its index (a slot, a vocabulary entry), so a token's numbers never depend on its batch or chunk.
inline void soft_cap_n(float* s, int64_t n, float cap) {
  int64_t i = 0;
#ifdef SLUICE_AVX512
  const __m512 c = _mm512_set1_ps(cap);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(s + i, _mm512_mul_ps(tanh16(_mm512_div_ps(_mm512_loadu_ps(s + i), c)), c));
#elif defined(SLUICE_AVX2)
  const __m256 c = _mm256_set1_ps(cap);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(s + i, _mm256_mul_ps(tanh8(_mm256_div_ps(_mm256_loadu_ps(s + i), c)), c));
#endif
  for (; i < n; ++i) s[i] = soft_cap(s[i], cap);
}

// out[i] = gelu_tanh(g[i]) * u[i] (u null: * 1) for i < n, activate's kGeluTanh, 16 lanes at a time where it can.
inline void gelu_tanh_mul(const float* g, const float* u, int64_t n, float* out) {
  int64_t i = 0;
#ifdef SLUICE_AVX512
  const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.f), k = _mm512_set1_ps(0.79788456080286536f),
               c = _mm512_set1_ps(0.044715f);
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 inner = _mm512_mul_ps(k, _mm512_add_ps(x, _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(c, x), x), x)));
    __m512 y = _mm512_mul_ps(_mm512_mul_ps(half, x), _mm512_add_ps(one, tanh16(inner)));
    if (u) y = _mm512_mul_ps(y, _mm512_loadu_ps(u + i));
    _mm512_storeu_ps(out + i, y);
  }
#elif defined(SLUICE_AVX2)
  const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.f), k = _mm256_set1_ps(0.79788456080286536f),
               c = _mm256_set1_ps(0.044715f);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 inner = _mm256_mul_ps(k, _mm256_add_ps(x, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(c, x), x), x)));
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(half, x), _mm256_add_ps(one, tanh8(inner)));
    if (u) y = _mm256_mul_ps(y, _mm256_loadu_ps(u + i));
    _mm256_storeu_ps(out + i, y);
  }
#endif
  for (; i < n; ++i) out[i] = activate(kGeluTanh, g[i]) * (u ? u[i] : 1.f);
}

// What a linear's weight is stored as: an nn.Linear's fp32 or bf16, model/quant.py's int8 codes, whose sums are
// multiplied by one fp32 scale per weight row once they are complete, or its int4 codes with a bf16 scale and zero
// per group of inputs (q4.h).
enum WeightKind { kF32, kBf16, kInt8, kInt4 };

struct Linear {  // weight (N, ldw) of which each row's first K are used, row scales s (int8 only), bias (N,) or absent
  const void* w = nullptr;
  WeightKind kind = kF32;
  const float* s = nullptr;
  // The model's weights stream from DRAM (Step::Step decides): decode's tiles prefetch the next rows into L2, not
  // L1. L1 has ~16 fill buffers, so T0 prefetches far ahead stall on them; L2 takes several times more misses in
  // flight. Qwen3-0.6B shape in bf16, 2-core Xeon: 11.2 -> 14.3-15.9 tok/s; the bundled model (its weights in
  // the last-level cache) ran ~5% faster with T0, so it keeps that.
  bool far = false;
  bool idot = false;  // int4, int8: the products take the integer dot (q4i.h, q8t.h), not the fp32-widening one
  bool bdot = false;  // bf16: x rounded to bf16 and vdpbf16ps (b16.h), not fp32 products
  bool rows = true;  // AVX-512 decode (M = 1): a tile's 16 rows read one after the other (tile_rows), or side by side
  const float* b = nullptr;
  int64_t n = 0, k = 0;
  int64_t ldw = 0;  // elements from a weight row to the next: K, or more for int8 rows padded to a multiple of 16;
                    // int4: bytes, K' / 2 for the row's K' >= K codes (K' a multiple of the group)
  const bf16* sz = nullptr;  // int4: scales_zeros (K' / group, ldsz, 2), (s, z) of group g, row n at 2 (g ldsz + n)
  int64_t ldsz = 0, group = 0;
  const uint8_t* wt = nullptr;  // int4/int8 with the integer dot: the codes in tiles of interleaved rows (q4t.h, q8t.h), ldt
  int64_t ldt = 0, tile = 0;    // bytes and rows a tile; row(i) is then the start of row i's tile
  const void* row(int64_t i) const {
    if (wt) return i < n ? wt + i / tile * ldt : nullptr;
    return i < n ? static_cast<const char*>(w) + i * ldw * (kind == kF32 ? 4 : kind == kBf16 ? 2 : 1) : nullptr;
  }
};

// A sum times its row's scale, rounded before anything is added to it: the opaque asm keeps the compiler from
// fusing the product into the bias or residual add in some callers and not others, which would make a token's
// last bits depend on the path (decode alone or in a batch) that computed it.
inline float scaled(float sum, const float* scale, int64_t n) {
  if (!scale) return sum;
  float p = sum * scale[n];
  asm("" : "+x"(p));
  return p;
}

#ifdef SLUICE_AVX512
// y[0:nr] (+)= s[0:nr] * scale[0:nr] + bias[0:nr] (scale null: no product; bias null: + 0, as before): the
// bias first, then the residual, as torch adds them.
inline void put16(__m512 s, const float* scale, const float* bias, int64_t nr, float* y, bool accumulate) {
  const __mmask16 k = first_lanes(nr);
  if (scale) {
    s = _mm512_mul_ps(s, _mm512_maskz_loadu_ps(k, scale));
    asm("" : "+v"(s));  // rounded before the adds, as scaled()
  }
  s = _mm512_add_ps(s, bias ? _mm512_maskz_loadu_ps(k, bias) : _mm512_setzero_ps());
  if (accumulate) s = _mm512_add_ps(_mm512_maskz_loadu_ps(k, y), s);
  _mm512_mask_storeu_ps(y, k, s);
}

// The same for a 4-row tile's vector: row m's sums s[4m:4m + nr] go to y + m * ldy, m < mm.
inline void put4(__m512 s, const float* scale, const float* bias, int64_t nr, float* y, int64_t ldy, int64_t mm,
                 bool accumulate) {
  const __mmask8 k = static_cast<__mmask8>((1u << nr) - 1);
  if (scale) {
    s = _mm512_mul_ps(s, _mm512_broadcast_f32x4(_mm_maskz_loadu_ps(k, scale)));
    asm("" : "+v"(s));
  }
  s = _mm512_add_ps(s, bias ? _mm512_broadcast_f32x4(_mm_maskz_loadu_ps(k, bias)) : _mm512_setzero_ps());
  alignas(64) float o[16];
  _mm512_store_ps(o, s);
  for (int64_t m = 0; m < mm; ++m) {
    __m128 v = _mm_load_ps(o + 4 * m);
    if (accumulate) v = _mm_add_ps(_mm_maskz_loadu_ps(k, y + m * ldy), v);
    _mm_mask_storeu_ps(y + m * ldy, k, v);
  }
}
#endif

// Scratch rows on cache lines: malloc gives a large block 16 bytes past a page boundary, so every 64-byte load of
// an activation row would straddle two lines (two loads for one) in the products' inner loops.
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) {
    void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
    if (!p) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};
using Scratch = std::vector<float, LineAligned<float>>;

constexpr int64_t kQueryGroup = 4;  // a chunk's tokens whose attention shares one pass over the cache (run)
constexpr int64_t kBlock = 16;  // weight rows per work item: 16 rows x K stay in L1/L2 across the M rows
constexpr int64_t kWidenRows = 16;  // token rows from which block() widens narrow weights once per pass
constexpr int64_t kPassBytes = 24 << 10;  // weights per pass of block()'s many-row tiles (see there)
constexpr int64_t kStreamBytes = int64_t{64} << 20;  // weights from this size on stream from DRAM (cpu_paths.AUTO_KERNEL_BYTES)

#ifdef SLUICE_AVX512
// out[0:K] = w[0:K] widened to fp32 (exact for bf16).
template <typename W>
inline void widen_row(const W* w, int64_t K, float* out) {
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) _mm512_storeu_ps(out + k, load16(w + k));
  for (; k < K; ++k) out[k] = widen(w[k]);
}
#endif

// n zero bytes in their own anonymous mapping, 2 MiB-aligned and advised MADV_HUGEPAGE before any page is touched,
// for the step's own copies of the weights (the int4/int8 tiles): a decode step streams them every token, and in
// 2 MiB pages it takes a TLB miss per 2 MiB instead of per 4 KiB (model/hugepages.py, which moves the module's
// weights the same way, says what that measured). torch::zeros where SLUICE_HUGE_PAGES is off (as there) or the
// mapping fails; the kernel zero-fills either way, so the contents are the same.
inline torch::Tensor huge_zeros(int64_t n) {
#ifdef __linux__
  const char* env = std::getenv("SLUICE_HUGE_PAGES");
  const std::string off = env ? env : "";
  if (off != "0" && off != "off" && off != "OFF" && off != "false" && off != "no") {
    const size_t huge = size_t{2} << 20, len = static_cast<size_t>(n) + huge;
    void* base = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base != MAP_FAILED) {
      char* p = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(base) + huge - 1) & ~(uintptr_t{huge} - 1));
      madvise(p, static_cast<char*>(base) + len - p, MADV_HUGEPAGE);  // (refused where THP is off: 4 KiB pages)
      return torch::from_blob(p, {n}, [base, len](void*) { munmap(base, len); }, torch::kUInt8);
    }
  }
#endif
  return torch::zeros({n}, torch::kUInt8);
}

#include "q4.h"
#include "q8t.h"
#include "b16.h"

// The input of L's products as its integer dot takes it (int4, int8 with idot), or none (the products read x).
inline bool takes_codes(const Linear& L) { return L.kind == kInt4 || (L.kind == kInt8 && L.idot); }
inline Q4In codes_input(const Linear& L, const float* x, int64_t M) {
  return L.kind == kInt4 ? q4_input(L, x, M) : takes_codes(L) ? q8t_input(L, x, M) : Q4In{};
}

// y[m, n - n0] (+)= x[m] . W[n] + b[n] for m < M and weight rows n0 <= n < n1. accumulate: the
// residual add, x + f(x), in the order torch adds (the bias before the residual). after: the weight rows
// (same K and type) this thread reads next, when they are not the rows after n1 (mlp_act's gate, then up):
// the last tiles prefetch those instead.
template <typename W>
void block(const Linear& L, const float* x, int64_t M, int64_t n0, int64_t n1, float* y, int64_t ldy,
           bool accumulate, const void* after) {
  const W* w = static_cast<const W*>(L.w);
  const int64_t K = L.k, ldw = L.ldw;
  auto put = [&](int64_t m, int64_t n, float s) {
    s = scaled(s, L.s, n);
    s += L.b ? L.b[n] : 0.f;
    float& dst = y[m * ldy + n - n0];
    dst = accumulate ? dst + s : s;
  };
#ifdef SLUICE_AVX512
  {
    constexpr bool b16 = std::is_same_v<W, bf16>;  // (b16.h: its tiles read the input as prepared for this linear)
    const B16In* in = b16 ? &b16_input(L, x, M, false) : nullptr;
    // M = 1 (decode): tiles of 16 weight rows x 1 activation row, read row after row (tile_rows; Linear::rows) or
    // side by side, the next 16 rows prefetched meanwhile. The same sums either way.
    const int64_t row_bytes = ldw * static_cast<int64_t>(sizeof(W));
    const W* wr[16];
    if (M == 1) {
      for (int64_t n = n0; n < n1; n += 16) {
        for (int r = 0; r < 16; ++r) wr[r] = w + std::min(n + r, n1 - 1) * ldw;
        const bool last = n + 16 >= n1 && after;
        const char* next = static_cast<const char*>(last ? after : L.row(n + 16));
        __m512 s;
        if (L.rows) {
          s = tile_rows_w<W>(wr, x, in, K, RowStream{next, row_bytes, last ? 16 : std::clamp<int64_t>(L.n - n - 16, 0, 16),
                                                     L.far});
        } else {  // 16 interleaved streams; the next 16 rows, 16 k of each (16 * sizeof(W) / 4 lines) per step
          Prefetch pf;
          pf.far = L.far, pf.p = next;
          s = tile_w<W, 16, 1, 16 * sizeof(W) / 4>(wr, x, in, 0, K, pf);
        }
        put16(s, L.s ? L.s + n : nullptr, L.b ? L.b + n : nullptr, std::min<int64_t>(16, n1 - n), y + n - n0,
              accumulate);
      }
      return;
    }
    // M > 1: tiles of 4 weight rows x 4 activation rows (a short last group repeats its last row), in
    // passes over `pass` weight rows: their weights (~kPassBytes) stay in L1 while every group of 4
    // activation rows runs over them, so each weight is read from memory once per block and each activation
    // row from L1 or L2 once per pass. Meanwhile the next pass's rows (or the next block's, which under
    // linear()'s guided schedule is usually this thread's next) are prefetched, spread over the pass's tiles,
    // into L2 only (_MM_HINT_T1): at K = 768 a pass (24 KB) + a group's activations (12 KB) + the next pass
    // fetched into L1 (24 KB) overflow its 48 KB; the next pass's first tiles pull their rows from L2 into L1
    // instead. Products alone (1 thread, weights from L3, old/new interleaved on a noisy machine): M = 64,
    // K = 768 won 5 rounds of 5 (median 33.6 -> 40.6 FLOP per TSC cycle), K = 256 even; M = 8 ~5% faster.
    // M <= 8 (decode batches, a speculative round's verify) passes over the whole block (16 rows): every group of
    // 4 activation rows runs over its weights, the second from L1, while the next 16 rows are prefetched into L1 (T0)
    // at an exact rate, kGroup lines a step for one group and kHalf for two, so the stream runs a whole pass ahead.
    // (Before 2026-12-05 such passes held one 4-row group, prefetching only the next group, ~100 cycles ahead at
    // K = 256; before that, 16-row passes spread a T1 stream over their tiles.) The bundled model's verify forward
    // at 300 cached positions, builds alternated (/work/.prof/verify_phases.py), in single-row steps: 3 rows
    // 1.09-1.16 -> 1.10-1.13, 4 rows 1.24-1.41 -> 1.24-1.27, 5 rows 1.73-1.93 -> 1.54-1.71, 6 rows 1.86-1.92 ->
    // 1.73-1.85, 8 rows even; same tiles, so the same bits. Weights streaming from DRAM (L.far) keep one-group
    // passes at 5-8 rows: the Qwen3-0.6B shape in bf16 ran 6 and 8 rows ~12% slower in 16-row passes.
    constexpr int R = 4;
    // A prefill chunk (M >= kWidenRows) whose weights are narrower than fp32 widens each pass's rows once into an
    // fp32 scratch, and its tiles read that: widening bf16 costs two uops per 16 weights on the ports the FMAs
    // use, which a 4 x 4 tile pays once per 16 FMAs (a third of its issue slots), the scratch once per pass. The
    // widening is exact and the tiles sum in the same order, so the bits are those of the tiles over W itself.
    const bool widen_pass = sizeof(W) < sizeof(float) && M >= kWidenRows && !L.bdot;  // (dot: reads bf16 itself)
    const int64_t pass_row_bytes = widen_pass ? K * static_cast<int64_t>(sizeof(float)) : row_bytes;
    const int64_t pass = M <= 4 || (M <= 8 && !L.far) ? kBlock : M <= 8 ? R
                       : std::clamp<int64_t>(kPassBytes / std::max<int64_t>(pass_row_bytes, 1) / R * R, R, 16);
    // Rows one cache line longer than K: rows 4 KB apart would all fall in the same L1 set.
    const int64_t lds = (K + 15) / 16 * 16 + 16;
    static thread_local Scratch scratch_store;
    if (widen_pass && static_cast<int64_t>(scratch_store.size()) < pass * lds) scratch_store.resize(pass * lds);
    float* const scratch = scratch_store.data();
    for (int64_t p0 = n0; p0 < n1; p0 += pass) {
      const int64_t p1 = std::min(n1, p0 + pass);
      if (widen_pass)
        for (int64_t n = p0; n < p1; ++n) {
          if constexpr (b16) widen_b16_row(w + n * ldw, K, scratch + (n - p0) * lds);  // de-interleaved as in->xd
          else widen_row(w + n * ldw, K, scratch + (n - p0) * lds);
        }
      Prefetch pf;
      pf.far = L.far;
      const void* next = p1 == n1 && after ? after : L.row(p1);
      if (next && K >= 16) {
        pf.p = static_cast<const char*>(next);
        pf.end = pf.p + (next == after ? pass : std::min(pass, L.n - p1)) * row_bytes;
        const int64_t steps = (M + 3) / 4 * ((p1 - p0 + R - 1) / R) * (K / 16), lines = (pf.end - pf.p + 63) / 64;
        pf.per_step = (lines + steps - 1) / steps;  // at M <= 4: R * sizeof(W) / 4, the rows of the next group
      }
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int64_t mm = std::min<int64_t>(4, M - m0);
        const float* xm = (b16 && widen_pass ? in->xd : x) + m0 * K;  // (the widened tiles: bf16 reads xd)
        for (int64_t n = p0; n < p1; n += R) {
          __m512 s;
          if (widen_pass) {  // the same tiles over the pass's fp32 copy (rows clamped as below)
            const float* wf[R];
            for (int r = 0; r < R; ++r) wf[r] = scratch + (std::min(n + r, n1 - 1) - p0) * lds;
            switch (mm) {
              case 1: s = tile<float, R, 1>(wf, xm, K, K, pf); break;
              case 2: s = tile<float, R, 2>(wf, xm, K, K, pf); break;
              case 3: s = tile<float, R, 3>(wf, xm, K, K, pf); break;
              default: s = tile<float, R, 4>(wf, xm, K, K, pf);
            }
            put4(s, L.s ? L.s + n : nullptr, L.b ? L.b + n : nullptr, std::min<int64_t>(R, n1 - n),
                 y + m0 * ldy + n - n0, ldy, mm, accumulate);
            continue;
          }
          for (int r = 0; r < R; ++r) wr[r] = w + std::min(n + r, n1 - 1) * ldw;
          constexpr int kGroup = R * sizeof(W) / 4;  // M <= 4: R rows of the next pass, 16 k, per step
          constexpr int kHalf = kGroup / 2 > 0 ? kGroup / 2 : 1;  // M 5-8: two groups share that stream
          switch (M <= 4 ? mm : M <= 8 ? 8 + mm : 4 + mm) {
            case 1: s = tile_w<W, R, 1, kGroup>(wr, x, in, m0, K, pf); break;
            case 2: s = tile_w<W, R, 2, kGroup>(wr, x, in, m0, K, pf); break;
            case 3: s = tile_w<W, R, 3, kGroup>(wr, x, in, m0, K, pf); break;
            case 4: s = tile_w<W, R, 4, kGroup>(wr, x, in, m0, K, pf); break;
            case 9: s = tile_w<W, R, 1, kHalf>(wr, x, in, m0, K, pf); break;
            case 10: s = tile_w<W, R, 2, kHalf>(wr, x, in, m0, K, pf); break;
            case 11: s = tile_w<W, R, 3, kHalf>(wr, x, in, m0, K, pf); break;
            case 12: s = tile_w<W, R, 4, kHalf>(wr, x, in, m0, K, pf); break;
            case 5: s = tile_w<W, R, 1>(wr, x, in, m0, K, pf); break;
            case 6: s = tile_w<W, R, 2>(wr, x, in, m0, K, pf); break;
            case 7: s = tile_w<W, R, 3>(wr, x, in, m0, K, pf); break;
            default: s = tile_w<W, R, 4>(wr, x, in, m0, K, pf);
          }
          put4(s, L.s ? L.s + n : nullptr, L.b ? L.b + n : nullptr, std::min<int64_t>(R, n1 - n), y + m0 * ldy + n - n0,
               ldy, mm, accumulate);
        }
      }
    }
    return;
  }
#endif
  float o[4][6];
  const W* wr[4];
  if (M == 1) {  // decode: 4 weight rows at a time (a short last group repeats its last row)
    for (int64_t n = n0; n < n1; n += 4) {
      for (int r = 0; r < 4; ++r) wr[r] = w + std::min(n + r, n1 - 1) * ldw;
      // the next 4 rows (contiguous), 32 weights of them per step: sizeof(W) / 2 lines (int8: one, running ahead)
      const char* next = n + 8 <= L.n ? static_cast<const char*>(L.row(n + 4)) : nullptr;
      dot_NxM<W, 4, 1, (sizeof(W) >= 2 ? sizeof(W) / 2 : 1)>(wr, x, K, K, o, next, L.far);
      for (int64_t r = 0; r < std::min<int64_t>(4, n1 - n); ++r) put(0, n + r, o[r][0]);
    }
    return;
  }
  // M > 1: tiles of 2 weight rows x 6 activation rows, 12 accumulators of AVX2's 16 registers (2 x 4 before: 6
  // loads per 8 FMAs and a widening per 4 of them where these take 8 per 12 and one per 6; the Qwen3-0.6B
  // shape's prefill ran ~4% faster in the AVX2 build on a Zen 5, alternating in one process; 3 x 4 spilled).
  for (int64_t m0 = 0; m0 < M; m0 += 6) {
    const int64_t mm = std::min<int64_t>(6, M - m0);
    const float* xm = x + m0 * K;
    for (int64_t n = n0; n < n1; n += 2) {
      wr[0] = w + n * ldw;
      wr[1] = w + std::min(n + 1, n1 - 1) * ldw;  // an odd last row pairs with itself
      switch (mm) {
        case 1: dot_NxM<W, 2, 1>(wr, xm, K, K, o); break;
        case 2: dot_NxM<W, 2, 2>(wr, xm, K, K, o); break;
        case 3: dot_NxM<W, 2, 3>(wr, xm, K, K, o); break;
        case 4: dot_NxM<W, 2, 4>(wr, xm, K, K, o); break;
        case 5: dot_NxM<W, 2, 5>(wr, xm, K, K, o); break;
        default: dot_NxM<W, 2, 6>(wr, xm, K, K, o);
      }
      for (int64_t m = 0; m < mm; ++m) {
        put(m0 + m, n, o[0][m]);
        if (n + 1 < n1) put(m0 + m, n + 1, o[1][m]);
      }
    }
  }
}

// q4: x as an int4 product takes it (q4_input), for an int4 L.
void block(const Linear& L, const float* x, const Q4In& q4, int64_t M, int64_t n0, int64_t n1, float* y, int64_t ldy,
           bool accumulate, const void* after = nullptr) {
  switch (L.kind) {
    case kInt4: return block_q4(L, q4, M, n0, n1, y, ldy, accumulate, after);
    case kBf16: return block<bf16>(L, x, M, n0, n1, y, ldy, accumulate, after);
    case kInt8:
      if (L.idot) return block_q8(L, q4, M, n0, n1, y, ldy, accumulate, after);
      return block<int8_t>(L, x, M, n0, n1, y, ldy, accumulate, after);
    default: return block<float>(L, x, M, n0, n1, y, ldy, accumulate, after);
  }
}

// y (M, N) (+)= x (M, K) W^T + b, this thread's share of the weight rows (call inside the parallel
// region: `omp for nowait`, the caller places the barrier, so independent products share one).
// Guided: each thread first takes a long contiguous run of blocks (so block()'s prefetch of the rows after
// its own is mostly for itself), then shorter ones, so a thread slowed by something else on its core (here
// one core often ran 15-20% slower than the other) does less instead of making the other wait at the
// barrier. Which thread computes a block changes no number.
void linear(const Linear& L, const float* x, int64_t M, float* y, int64_t ldy, bool accumulate = false) {
  const Q4In q4 = codes_input(L, x, M);
  b16_prepare(L, x, M);
#pragma omp for schedule(guided) nowait
  for (int64_t n0 = 0; n0 < L.n; n0 += kBlock)
    block(L, x, q4, M, n0, std::min(L.n, n0 + kBlock), y + n0, ldy, accumulate);
}

// act (M, I) = act(x gate^T + bg) * (x up^T + bu), or act(x up^T + bu) for an ungated MLP (GPT-2, NeoX):
// both products of a block of rows into the thread's scratch `tmp` (2 * M * kBlock), then combined, so the
// MLP needs no barrier in between.
void mlp_act(const Linear& gate, const Linear& up, int64_t kind, const float* x, int64_t M, float* act, float* tmp) {
  float* u = tmp + M * kBlock;
  const Q4In q4 = codes_input(takes_codes(up) || !gate.w ? up : gate, x, M);
  b16_prepare(up.kind == kBf16 ? up : gate, x, M);  // (gate and up: one input, one K)
#pragma omp for schedule(guided) nowait
  for (int64_t n0 = 0; n0 < up.n; n0 += kBlock) {
    const int64_t n1 = std::min(up.n, n0 + kBlock);
    if (!gate.w) {
      block(up, x, q4, M, n0, n1, act + n0, up.n, false);
      for (int64_t m = 0; m < M; ++m) {
        float* a = act + m * up.n + n0;
        if (kind == kGeluTanh) gelu_tanh_mul(a, nullptr, n1 - n0, a);
        else for (float* e = a; e < a + n1 - n0; ++e) *e = activate(kind, *e);
      }
      continue;
    }
    // While the gate's last rows run, the up rows of this block are prefetched, and vice versa the gate's
    // next rows (usually this thread's next block: guided schedule).
    block(gate, x, q4, M, n0, n1, tmp, kBlock, false, up.row(n0));
    block(up, x, q4, M, n0, n1, u, kBlock, false, gate.row(n1));
    for (int64_t m = 0; m < M; ++m) {
      const float *g = tmp + m * kBlock, *um = u + m * kBlock;
      float* a = act + m * up.n + n0;
      if (kind == kSilu) silu_mul(g, um, n1 - n0, a);
      else if (kind == kGeluTanh) gelu_tanh_mul(g, um, n1 - n0, a);
      else for (int64_t i = 0; i < n1 - n0; ++i) a[i] = activate(kind, g[i]) * um[i];
    }
  }
}

// RMSNorm as layers.py computes it in fp32: x / sqrt(mean(x^2) + eps) * (w + offset).
// The sum of squares is one chain in a fixed form: rounded squares added in order, the last C % 8 fused
// (what GCC 12 made of a plain `ss += x * x` loop, kept so the numbers stay the same), written out so
// that no compiler's contraction choice makes a row alone differ from a row of 8+ (rms_norm_rows' gather).
// rms_norm_chains runs R rows at once, each row that chain, the R chains side by side; rms_norm is one row.
template <int R>
inline void rms_norm_chains(const float* x, int64_t ldx, const float* w, float offset, float eps, int64_t C, float* out,
                            int64_t ldo) {
  float ss[R];
  for (int m = 0; m < R; ++m) ss[m] = 0.f;
  const int64_t C8 = C / 8 * 8;
  for (int64_t c = 0; c < C8; ++c)
    for (int m = 0; m < R; ++m) {
      float sq = x[m * ldx + c] * x[m * ldx + c];
      asm("" : "+x"(sq));  // opaque: the square stays rounded, never fused into the add
      ss[m] += sq;
    }
  for (int64_t c = C8; c < C; ++c)
    for (int m = 0; m < R; ++m) ss[m] = std::fma(x[m * ldx + c], x[m * ldx + c], ss[m]);
  for (int m = 0; m < R; ++m) {
    const float inv = 1.f / std::sqrt(ss[m] / static_cast<float>(C) + eps), *xr = x + m * ldx;
    float* o = out + m * ldo;
    for (int64_t c = 0; c < C; ++c) o[c] = (xr[c] * inv) * (w[c] + offset);
  }
}

inline void rms_norm(const float* x, const float* w, float offset, float eps, int64_t C, float* out) {
  rms_norm_chains<1>(x, 0, w, offset, eps, C, out, 0);
}

// rms_norm of n rows, x + m * ldx into out + m * ldo (in place is fine), bit for bit. rms_norm's sum of
// squares is one chain of C dependent adds (GCC may not reorder them), ~4 cycles per element; with AVX-512
// the sums run 16 rows at once, a row per lane, each lane rms_norm's chain, and the rest (an exact division
// and square root, then per element) is elementwise anyway.
inline void rms_norm_rows(const float* x, int64_t ldx, const float* w, float offset, float eps, int64_t C,
                          int64_t n, float* out, int64_t ldo) {
  int64_t m0 = 0;
#ifdef SLUICE_AVX512
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int>(ldx)));
  for (; n - m0 >= 8; m0 += 16) {  // (a gather for fewer rows costs more than interleaved scalar chains, below)
    const __mmask16 live = first_lanes(n - m0);
    const float* xm = x + m0 * ldx;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t c = 0; c < C; ++c) {
      const __m512 v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, rows, xm + c, 4);
      if (c < C / 8 * 8) {
        __m512 sq = _mm512_mul_ps(v, v);
        asm("" : "+v"(sq));  // opaque: the square stays rounded, never fused into the add
        ss = _mm512_add_ps(ss, sq);
      } else {
        ss = _mm512_fmadd_ps(v, v, ss);
      }
    }
    alignas(64) float inv[16];
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_sqrt_ps(_mm512_add_ps(
                                          _mm512_div_ps(ss, _mm512_set1_ps(static_cast<float>(C))), _mm512_set1_ps(eps)))));
    for (int64_t m = 0; m < std::min<int64_t>(16, n - m0); ++m) {
      const float *xr = xm + m * ldx, iv = inv[m];
      float* o = out + (m0 + m) * ldo;
      for (int64_t c = 0; c < C; ++c) o[c] = (xr[c] * iv) * (w[c] + offset);
    }
  }
#endif
  // The rest up to 4 rows at a time: each row rms_norm's chain, the rows' chains interleaved, so their adds
  // overlap instead of waiting on one another (~4 cycles each: a verify's 3 rows took 3 chains' time).
  for (; n - m0 >= 4; m0 += 4) rms_norm_chains<4>(x + m0 * ldx, ldx, w, offset, eps, C, out + m0 * ldo, ldo);
  switch (n - m0) {
    case 3: rms_norm_chains<3>(x + m0 * ldx, ldx, w, offset, eps, C, out + m0 * ldo, ldo); break;
    case 2: rms_norm_chains<2>(x + m0 * ldx, ldx, w, offset, eps, C, out + m0 * ldo, ldo); break;
    case 1: rms_norm(x + m0 * ldx, w, offset, eps, C, out + m0 * ldo); break;
    default: break;
  }
}

// LayerNorm as F.layer_norm computes it in fp32: (x - mean) / sqrt(var + eps) * w + b, the biased
// variance. The moments are summed in double, so they are as exact as torch's (Welford) ones or better.
inline void layer_norm(const float* x, const float* w, const float* b, float eps, int64_t C, float* out) {
  double s = 0.0, ss = 0.0;
  for (int64_t c = 0; c < C; ++c) s += x[c];
  const double mean = s / static_cast<double>(C);
  for (int64_t c = 0; c < C; ++c) ss += (x[c] - mean) * (x[c] - mean);
  const float mu = static_cast<float>(mean);
  const float inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(C) + eps));
  for (int64_t c = 0; c < C; ++c) out[c] = (x[c] - mu) * inv * w[c] + (b ? b[c] : 0.f);
}

// A norm's tensors: gain w (absent: no norm there, the rows pass unchanged) and LayerNorm's bias b.
struct Norm {
  const float *w = nullptr, *b = nullptr;
};

// What a model's norms share (fast_step.py checks they do): RMSNorm or LayerNorm, eps, RMSNorm's gain offset.
struct NormKind {
  bool layer = false;
  float eps = 1e-6f, offset = 0.f;

  // out rows = norm(x rows), n rows of C channels, x + m * ldx into out + m * ldo (in place is fine).
  void operator()(const Norm& N, const float* x, int64_t ldx, int64_t C, int64_t n, float* out, int64_t ldo) const {
    if (!N.w) {
      if (out != x)
        for (int64_t m = 0; m < n; ++m) std::copy(x + m * ldx, x + m * ldx + C, out + m * ldo);
    } else if (layer) {
      for (int64_t m = 0; m < n; ++m) layer_norm(x + m * ldx, N.w, N.b, eps, C, out + m * ldo);
    } else {
      rms_norm_rows(x, ldx, N.w, offset, eps, C, n, out, ldo);
    }
  }
};

// RoPE on the first R channels of one head, halves layout: the pair (x[i], x[i + R/2]) turns by the
// position's angle i (cos/sin precomputed per token, R/2 each); channels R.. pass unrotated.
inline void rope(float* x, const float* cs, const float* sn, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * cs[i] - b * sn[i];
    x[i + half] = b * cs[i] + a * sn[i];
  }
}

// The KV cache's slots hold fp32, or bf16 (LLM(kv_cache_dtype="bfloat16")): each key and value rounded to bf16 as
// it is written (to nearest even, as torch's .to(bfloat16) rounds: c10's conversion) and widened exactly as it is
// read, so attention over a bf16 cache is the fp32 cache's arithmetic over the rounded values, in every build.
inline void store_slot(const float* x, int64_t D, float* dst) { std::copy(x, x + D, dst); }
inline void store_slot(const float* x, int64_t D, bf16* dst) {
  for (int64_t d = 0; d < D; ++d) dst[d] = bf16(x[d]);
}

// Visits the slots lo..p of one row and head in order, block by block: f(s, slot s's D values). head: the
// head's slot 0 in pool block 0; blocks: the row's block ids, bs slots each, sBlock apart; sS: one slot.
// Walking block by block costs one division per walk, not one per slot. While a block is read, the same
// slots of the row's next block are prefetched: blocks lie anywhere in the pool, so the hardware prefetcher
// would start cold at each block (bs = 16 ran ~15% slower than the static cache at 2000 slots without this,
// and on par with it). Within one run of slots (a static cache's row, the paged cache's last block) each slot
// prefetches the one kSlotsAhead on: the hardware prefetcher alone streamed a static cache at ~20 GB/s on a
// Zen 5 (the Qwen3-0.6B shape's decode at 1024 cached positions, fp32 cache: attention 11.7 ms a token, 6.6
// with this, 4, 8 or 16 slots ahead alike).
constexpr int64_t kSlotsAhead = 8;
template <typename S, typename F>
inline void for_slots(const S* head, const int64_t* blocks, int64_t bs, int64_t sBlock, int64_t sS, int64_t D,
                      int64_t lo, int64_t p, F&& f) {
  for (int64_t j = lo / bs, s = lo; s <= p; ++j) {
    const int64_t base = blocks[j] * sBlock - j * bs * sS;  // slot s of block j is at head + base + s * sS
    const int64_t end = std::min(p + 1, (j + 1) * bs);
    const int64_t ahead = end <= p ? (blocks[j + 1] - blocks[j]) * sBlock : 0;  // from a slot to the next block's
    for (; s < end; ++s) {
      const S* slot = head + (base + s * sS);
      if (ahead)
        for (int64_t c = 0; c < D; c += 64 / sizeof(S)) __builtin_prefetch(slot + ahead + c);  // a cache line
      else if (s + kSlotsAhead < end)  // the last block, or a static cache's one run of slots: kSlotsAhead on
        for (int64_t c = 0; c < D; c += 64 / sizeof(S)) __builtin_prefetch(slot + kSlotsAhead * sS + c);
      f(s, slot);
    }
  }
}

#ifdef SLUICE_AVX512
// 16 lanes of a cache slot (lanes outside k zero), widened to fp32.
inline __m512 load_slot16(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
inline __m512 load_slot16(const bf16* p, __mmask16 k) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

// o[h] = sum over slots t of w[h][t] * v_t for NH (<= 4) query heads at once: each value vector, loaded once,
// feeds NH accumulators, 64 channels (four registers) per pass.
template <int NH, typename S>
inline void weighted_values(const S* vh, const int64_t* blocks, int64_t bs, int64_t sBlock, int64_t sS,
                            int64_t D, int64_t lo, int64_t p, const float* w, int64_t ldw, float* const* o) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    __m512 a[NH][4];
    __mmask16 k[4];
    for (int c = 0; c < 4; ++c) {
      k[c] = first_lanes(std::max<int64_t>(0, D - d0 - 16 * c));
      for (int h = 0; h < NH; ++h) a[h][c] = _mm512_setzero_ps();
    }
    for_slots(vh, blocks, bs, sBlock, sS, D, lo, p, [&](int64_t t, const S* vs) {
      for (int c = 0; c < 4; ++c) {
        const __m512 v = load_slot16(vs + d0 + 16 * c, k[c]);
        for (int h = 0; h < NH; ++h) a[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(w[h * ldw + t]), v, a[h][c]);
      }
    });
    for (int h = 0; h < NH; ++h)
      for (int c = 0; c < 4; ++c) _mm512_mask_storeu_ps(o[h] + d0 + 16 * c, k[c], a[h][c]);
  }
}

// s[0:n] = softmax(s[0:n]) in place.
inline void softmax(float* s, int64_t n) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 16) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, first_lanes(n - i), s + i));
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = first_lanes(n - i);
    const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), top)));
    _mm512_mask_storeu_ps(s + i, k, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 total = _mm512_set1_ps(_mm512_reduce_add_ps(sum));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = first_lanes(n - i);
    _mm512_mask_storeu_ps(s + i, k, _mm512_div_ps(_mm512_maskz_loadu_ps(k, s + i), total));
  }
}
#elif defined(SLUICE_AVX2)
// 8 lanes of a cache slot, widened to fp32: all 8, or (Tail) those in k, the others zero.
template <bool Tail>
inline __m256 load_slot8(const float* p, __m256i k) { return Tail ? _mm256_maskload_ps(p, k) : _mm256_loadu_ps(p); }
template <bool Tail>
inline __m256 load_slot8(const bf16* p, __m256i k) {
  __m128i h;
  if (Tail) {  // (no 16-bit masked load before AVX-512: the live lanes through a zeroed copy)
    alignas(16) uint16_t t[8] = {};
    alignas(32) int32_t live[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(live), k);
    for (int i = 0; i < 8; ++i)
      if (live[i]) t[i] = reinterpret_cast<const uint16_t*>(p)[i];
    h = _mm_load_si128(reinterpret_cast<const __m128i*>(t));
  } else {
    h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The AVX-512 pair above in 8 lanes. weighted_values8: o[h] = sum over slots t of w[h][t] * v_t for NH (<= 3)
// query heads at once, channels d0 .. d0 + 32 (four registers) per pass; Tail: the pass reaches past D (masked).
template <int NH, bool Tail, typename S>
inline void weighted_values8(const S* vh, const int64_t* blocks, int64_t bs, int64_t sBlock, int64_t sS,
                             int64_t D, int64_t d0, int64_t lo, int64_t p, const float* w, int64_t ldw,
                             float* const* o) {
  __m256 a[NH][4];
  __m256i k[4];
  for (int c = 0; c < 4; ++c) {
    k[c] = first_lanes8(std::max<int64_t>(0, D - d0 - 8 * c));
    for (int h = 0; h < NH; ++h) a[h][c] = _mm256_setzero_ps();
  }
  for_slots(vh, blocks, bs, sBlock, sS, D, lo, p, [&](int64_t t, const S* vs) {
    for (int c = 0; c < 4; ++c) {
      const __m256 v = load_slot8<Tail>(vs + d0 + 8 * c, k[c]);
      for (int h = 0; h < NH; ++h) a[h][c] = _mm256_fmadd_ps(_mm256_set1_ps(w[h * ldw + t]), v, a[h][c]);
    }
  });
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < 4; ++c) {
      if (Tail)
        _mm256_maskstore_ps(o[h] + d0 + 8 * c, k[c], a[h][c]);
      else
        _mm256_storeu_ps(o[h] + d0 + 8 * c, a[h][c]);
    }
}
template <int NH, typename S>
inline void weighted_values(const S* vh, const int64_t* blocks, int64_t bs, int64_t sBlock, int64_t sS,
                            int64_t D, int64_t lo, int64_t p, const float* w, int64_t ldw, float* const* o) {
  int64_t d0 = 0;
  for (; d0 + 32 <= D; d0 += 32) weighted_values8<NH, false>(vh, blocks, bs, sBlock, sS, D, d0, lo, p, w, ldw, o);
  if (d0 < D) weighted_values8<NH, true>(vh, blocks, bs, sBlock, sS, D, d0, lo, p, w, ldw, o);
}

// s[0:n] = softmax(s[0:n]) in place.
inline void softmax(float* s, int64_t n) {
  __m256 mx = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + i));
  float top = -INFINITY;
  for (int l = 0; l < 8; ++l) top = std::max(top, mx[l]);
  for (; i < n; ++i) top = std::max(top, s[i]);
  const __m256 topv = _mm256_set1_ps(top);
  __m256 sum = _mm256_setzero_ps();
  for (i = 0; i < n; i += 8) {
    const __m256i k = first_lanes8(n - i);
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(s + i, k), topv)), _mm256_castsi256_ps(k));
    _mm256_maskstore_ps(s + i, k, e);
    sum = _mm256_add_ps(sum, e);
  }
  const __m256 total = _mm256_set1_ps(sluice_simd::hsum(sum));
  for (i = 0; i < n; i += 8) {
    const __m256i k = first_lanes8(n - i);
    _mm256_maskstore_ps(s + i, k, _mm256_div_ps(_mm256_maskload_ps(s + i, k), total));
  }
}
#endif

#ifdef SLUICE_AVX2
// for_slots over the keys lo..p, N slots at a time: scores(ks, cnt, first) for each group of cnt <= N slot pointers
// (the last group may be short: its pointers past cnt repeat the first, and their lanes are dropped), whose
// slots are first .. first + cnt - 1.
template <int N, typename S, typename F>
inline void key_groups(const S* kh, const int64_t* blocks, int64_t bs, int64_t sBlock, int64_t sS, int64_t D,
                       int64_t lo, int64_t p, F&& scores) {
  const S* ks[N];
  int cnt = 0;
  int64_t first = lo;
  auto flush = [&]() {
    for (int j = cnt; j < N; ++j) ks[j] = ks[0];
    scores(ks, cnt, first);
    first += cnt;
    cnt = 0;
  };
  for_slots(kh, blocks, bs, sBlock, sS, D, lo, p, [&](int64_t, const S* slot) {
    ks[cnt++] = slot;
    if (cnt == N) flush();
  });
  if (cnt) flush();
}

#ifdef SLUICE_AVX512
// attend()'s scores for NP pairs (queries q[0..NP-1]) and KB slots (keys ks[0..KB-1], the first kcnt of them
// real), NP * KB <= 16: dst[h][j0 + j] = scale * q[h] . ks[j] for j < kcnt. Accumulator (h, j) sums fma(key,
// query) over ascending d in 16 lanes and reduce16 sums its lanes, by one path whatever its place in the tile,
// so a score has the same bits in every tile shape (the decode step's 2 pairs, a prefill pass's 8 or more).
// The loops are unrolled by pragma so that the accumulators stay in registers.
template <int NP, int KB, typename S>
__attribute__((always_inline)) inline void score_tile(const float* const* q, const S* const* ks, int64_t D,
                                                      float scale, int kcnt, float* const* dst, int j0 = 0) {
  static_assert(NP * KB <= 16, "one reduce16 per tile");
  __m512 a[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 k = first_lanes(D - d);
    __m512 qh[NP];
#pragma GCC unroll 16
    for (int h = 0; h < NP; ++h) qh[h] = _mm512_maskz_loadu_ps(k, q[h] + d);
#pragma GCC unroll 16
    for (int j = 0; j < KB; ++j) {
      const __m512 kv = load_slot16(ks[j] + d, k);
#pragma GCC unroll 16
      for (int h = 0; h < NP; ++h) a[h * KB + j] = _mm512_fmadd_ps(kv, qh[h], a[h * KB + j]);
    }
  }
  const __m512 r = _mm512_mul_ps(reduce16(a), _mm512_set1_ps(scale));  // pair h's scores at lanes h * KB ..
#pragma GCC unroll 16
  for (int h = 0; h < NP; ++h) {
    const __m512 rh = h ? _mm512_maskz_compress_ps(static_cast<__mmask16>(first_lanes(KB) << (h * KB)), r) : r;
    _mm512_mask_storeu_ps(dst[h] + j0, first_lanes(kcnt), rh);
  }
}
#else
// score_tile in 8 lanes (NP * KB <= 8, reduce8): the first `full` channels (D rounded down to 8) unmasked, the
// rest through `tail`.
template <int NP, int KB, typename S>
__attribute__((always_inline)) inline void score_tile8(const float* const* q, const S* const* ks, int64_t D,
                                                       int64_t full, __m256i tail, float scale, int kcnt,
                                                       float* const* dst, int j0 = 0) {
  static_assert(NP * KB <= 8, "one reduce8 per tile");
  __m256 a[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < full; d += 8) {
    __m256 qh[NP];
#pragma GCC unroll 8
    for (int h = 0; h < NP; ++h) qh[h] = _mm256_loadu_ps(q[h] + d);
#pragma GCC unroll 8
    for (int j = 0; j < KB; ++j) {
      const __m256 kv = load_slot8<false>(ks[j] + d, tail);
#pragma GCC unroll 8
      for (int h = 0; h < NP; ++h) a[h * KB + j] = _mm256_fmadd_ps(kv, qh[h], a[h * KB + j]);
    }
  }
  if (full < D) {
    __m256 qh[NP];
#pragma GCC unroll 8
    for (int h = 0; h < NP; ++h) qh[h] = _mm256_maskload_ps(q[h] + full, tail);
#pragma GCC unroll 8
    for (int j = 0; j < KB; ++j) {
      const __m256 kv = load_slot8<true>(ks[j] + full, tail);
#pragma GCC unroll 8
      for (int h = 0; h < NP; ++h) a[h * KB + j] = _mm256_fmadd_ps(kv, qh[h], a[h * KB + j]);
    }
  }
  alignas(32) float r[8];
  _mm256_store_ps(r, _mm256_mul_ps(reduce8(a), _mm256_set1_ps(scale)));  // pair h's scores at r[h * KB ..]
#pragma GCC unroll 8
  for (int h = 0; h < NP; ++h)
    for (int j = 0; j < kcnt; ++j) dst[h][j0 + j] = r[h * KB + j];
}
#endif

// attend()'s vector paths once the scores sc (N rows of `span`, pair i's slots los[i]..ps[i] inside lo..p) are in:
// each pair's soft-cap and softmax over its own slots, its weights zero on the rest of lo..p, then o[i] = the
// weighted sum of the values over lo..p, up to MaxHeads pairs a pass over them (4 with AVX-512's 32 registers, 3
// with AVX2's 16). A zero weight adds exactly nothing (fma(0, v, a) = a for finite v: the slots a pair does not
// attend to are the other pairs' own, written by this step), so each pair's sums are those of a pass over its
// own slots alone, in the same order.
template <int MaxHeads, typename S>
inline void weigh_values(const S* vh, const int64_t* blocks, int64_t bs, int64_t sBlock, int64_t sS, int64_t D,
                         const int64_t* los, const int64_t* ps, int64_t lo, int64_t p, int64_t N, float cap,
                         float* sc, int64_t span, float* const* o) {
  for (int64_t h = 0; h < N; ++h) {
    float* row = sc + h * span;
    if (cap > 0.f) soft_cap_n(row + los[h], ps[h] + 1 - los[h], cap);
    softmax(row + los[h], ps[h] + 1 - los[h]);
    std::fill(row + lo, row + los[h], 0.f);
    std::fill(row + ps[h] + 1, row + p + 1, 0.f);
  }
  for (int64_t h0 = 0; h0 < N; h0 += MaxHeads) {
    const float* w = sc + h0 * span;
    switch (std::min<int64_t>(MaxHeads, N - h0)) {
      case 1: weighted_values<1>(vh, blocks, bs, sBlock, sS, D, lo, p, w, span, o + h0); break;
      case 2: weighted_values<2>(vh, blocks, bs, sBlock, sS, D, lo, p, w, span, o + h0); break;
      case 3: weighted_values<3>(vh, blocks, bs, sBlock, sS, D, lo, p, w, span, o + h0); break;
      default: weighted_values<MaxHeads>(vh, blocks, bs, sBlock, sS, D, lo, p, w, span, o + h0);
    }
  }
}
#endif

// N (query head, token) pairs that share one KV head (kh, vh: for_slots's `head`) and one row's blocks: pair i's
// query qv[i] (D floats) over its slots los[i]..ps[i]: softmax of the scaled scores q.k, soft-capped if cap > 0
// (sc: scratch, N rows of `span` floats indexed by slot), then o[i] (D floats) = the weighted sum of the values.
// One pass over the keys and values of lo..p, the union of the pairs' slots, serves them all: the cache is read
// once per KV head and group of tokens, not once per query head and token. Each score is its own dot product
// and each pair's weighted sum runs in slot order (weigh_values), so a pair's numbers do not depend on the
// others in its pass.
template <typename S>
inline void attend(const float* const* qv, float* const* o, const int64_t* los, const int64_t* ps, int64_t N,
                   const S* kh, const S* vh, const int64_t* blocks, int64_t bs, int64_t sBlock, int64_t sS, int64_t D,
                   float scale, float cap, float* sc, int64_t span) {
  const int64_t lo = *std::min_element(los, los + N), p = *std::max_element(ps, ps + N);
#ifdef SLUICE_AVX512
  // Scores 16 slots at a time, as register tiles of 2 pairs x 8 slots (score_tile; 1 x 16 for an odd last
  // pair): each key vector, loaded (and widened) once, serves both pairs, each query vector 8 slots. The
  // group's 16 keys stay in L1 for its other pairs.
  key_groups<16>(kh, blocks, bs, sBlock, sS, D, lo, p, [&](const S* const* ks, int cnt, int64_t first) {
    for (int64_t h = 0; h < N; h += 2) {
      // The second pair's row only where there is one (past the last pair it could point past the scratch).
      float* dst[2] = {sc + h * span + first, h + 1 < N ? sc + (h + 1) * span + first : nullptr};
      if (h + 1 == N) {
        score_tile<1, 16>(qv + h, ks, D, scale, cnt, dst);
      } else {
        score_tile<2, 8>(qv + h, ks, D, scale, std::min(cnt, 8), dst);
        if (cnt > 8) score_tile<2, 8>(qv + h, ks + 8, D, scale, cnt - 8, dst, 8);
      }
    }
  });
  weigh_values<4>(vh, blocks, bs, sBlock, sS, D, los, ps, lo, p, N, cap, sc, span, o);
#elif defined(SLUICE_AVX2)
  // The AVX-512 path's shape in 8 lanes: scores 8 slots at a time, as tiles of 2 pairs x 4 slots (score_tile8),
  // the softmax in vector lanes, the values for up to 3 heads a pass.
  const int64_t full = D / 8 * 8;
  const __m256i tail = first_lanes8(D - full);
  key_groups<8>(kh, blocks, bs, sBlock, sS, D, lo, p, [&](const S* const* ks, int cnt, int64_t first) {
    for (int64_t h = 0; h < N; h += 2) {
      float* dst[2] = {sc + h * span + first, h + 1 < N ? sc + (h + 1) * span + first : nullptr};
      if (h + 1 == N) {
        score_tile8<1, 8>(qv + h, ks, D, full, tail, scale, cnt, dst);
      } else {
        score_tile8<2, 4>(qv + h, ks, D, full, tail, scale, std::min(cnt, 4), dst);
        if (cnt > 4) score_tile8<2, 4>(qv + h, ks + 4, D, full, tail, scale, cnt - 4, dst, 4);
      }
    }
  });
  weigh_values<3>(vh, blocks, bs, sBlock, sS, D, los, ps, lo, p, N, cap, sc, span, o);
#else
  std::vector<float> wide(std::is_same_v<S, float> ? 0 : D);  // a bf16 slot widened, for dot() and the sum
  auto as_float = [&](const S* slot) -> const float* {
    if constexpr (std::is_same_v<S, float>) {
      return slot;
    } else {
      for (int64_t d = 0; d < D; ++d) wide[d] = widen(slot[d]);
      return wide.data();
    }
  };
  (void)lo, (void)p;  // (each pair over its own slots)
  for (int64_t h = 0; h < N; ++h, sc += span) {
    const float* qh = qv[h];
    float* oh = o[h];
    float mx = -INFINITY;
    for_slots(kh, blocks, bs, sBlock, sS, D, los[h], ps[h], [&](int64_t s, const S* ks) {
      sc[s] = dot(as_float(ks), qh, D) * scale;
      if (cap > 0.f) sc[s] = soft_cap(sc[s], cap);
      mx = std::max(mx, sc[s]);
    });
    float sum = 0.f;
    for (int64_t s = los[h]; s <= ps[h]; ++s) sum += (sc[s] = std::exp(sc[s] - mx));
    std::fill(oh, oh + D, 0.f);
    for_slots(vh, blocks, bs, sBlock, sS, D, los[h], ps[h], [&](int64_t s, const S* slot) {
      const float* vs = as_float(slot);
      const float w = sc[s] / sum;
      for (int64_t d = 0; d < D; ++d) oh[d] += w * vs[d];
    });
  }
#endif
}

struct Layer {
  Linear q, k, v, o, gate, up, down;  // gate.w null: an ungated MLP, act(up(x))
  // Absent norms have w null. Pre: attn_norm, mlp_norm; after each branch: attn_post, mlp_post (sandwich:
  // all four, Gemma 2/3; post: only these two, OLMo 2). q/k norms per head, or over the whole width.
  Norm attn_norm, q_norm, k_norm, attn_post, mlp_norm, mlp_post;
  int64_t window = 0;  // sliding window in slots; 0 = all slots up to the position
  float softcap = 0.f;  // the attention-score soft-cap; 0 = none
  bool local_rope = false;  // RoPE from the second table, inv_freq_local (Gemma 3's sliding layers)
};

// A Linear over weight (N, in) fp32 or bf16, int8 codes (N, >= in) with their row scales (N,) fp32, or int4 codes
// in quant.py's nibble layout (N, K' / 2) uint8 with their scales_zeros (K' / group, >= N, 2) bf16 (scale: absent
// for float weights); `in`, the product's input width, is the step's, so a weight of the wrong shape is refused here.
Linear make_linear(const torch::Tensor& w, const float* bias, const torch::Tensor& scale, int64_t in,
                   const char* what) {
  Linear L;
  if (!w.numel()) return L;  // absent: w null
  const bool int8 = w.scalar_type() == torch::kChar, int4 = w.scalar_type() == torch::kByte;
  const int64_t codes = w.dim() == 2 ? w.size(1) * (int4 ? 2 : 1) : 0;  // per row
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && (int8 || int4 ? codes >= in : codes == in), "Step: the ", what,
              " weight must be contiguous (N, ", in, ")", int8 || int4 ? " or wider (padded rows)" : "");
  TORCH_CHECK((int8 || int4) == (scale.numel() > 0), "Step: the ", what,
              " weight has scales exactly when it is int8 or int4");
  if (int8) {
    TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.numel() == w.size(0),
                "Step: the ", what, " weight's scales must be fp32 (", w.size(0), ",)");
    L.s = scale.data_ptr<float>();
  }
  if (int4) {
    TORCH_CHECK(scale.scalar_type() == torch::kBFloat16 && scale.is_contiguous() && scale.dim() == 3 &&
                    scale.size(2) == 2 && scale.size(1) >= w.size(0) && codes % scale.size(0) == 0,
                "Step: the ", what, " weight's scales_zeros must be bf16 (groups, >= ", w.size(0), ", 2)");
    L.group = codes / scale.size(0);
    TORCH_CHECK((L.group == 32 || L.group == 64 || L.group == 128 || L.group == 256) && codes - in < L.group,
                "Step: the ", what, " weight's groups of ", L.group, " inputs must be 32, 64, 128 or 256 and pad ", in,
                " inputs by less than a group");
    L.sz = scale.data_ptr<bf16>();
    L.ldsz = scale.size(1);
  }
  L.w = w.data_ptr();
  L.kind = int4 ? kInt4 : int8 ? kInt8 : w.scalar_type() == torch::kBFloat16 ? kBf16 : kF32;
  L.b = bias;
  L.n = w.size(0);
  L.k = in;
  L.ldw = w.size(1);
  return L;
}

// The phases `counters` times (fast_step.PHASES names them, in this order, as the profile's components).
enum Phase { kEmbedding, kNorms, kQkv, kAttention, kO, kMlp, kFinalNorm, kHead, kPhases };

class Step {
 public:
  // tensors: per layer, in this order, an empty tensor for an absent one (see fast_step.py). scales: per layer the
  // row scales (int8) or scales_zeros (int4) of q, k, v, o, gate, up, down, then the head's, each empty for a float
  // weight.
  static constexpr int kPerLayer = 26, kLinearsPerLayer = 7;
  // opts: the model-wide numbers and switches, each key required (a misspelt one is an error, not a default).
  static constexpr const char* kOpts[] = {"eps", "norm_offset", "layer_norm", "scale", "act", "qk_full_width",
                                          "parallel_residual", "embed_scale", "final_softcap", "int4_dot",
                                          "bf16_dot", "int8_dot", "decode_rows"};

  Step(std::vector<torch::Tensor> tensors, torch::Tensor embed, torch::Tensor pos_embed,
       std::vector<torch::Tensor> final_norm, torch::Tensor head, std::vector<torch::Tensor> scales,
       torch::Tensor inv_freq, torch::Tensor inv_freq_local, std::vector<int64_t> windows, std::vector<double> softcaps,
       std::vector<bool> local_rope, int64_t heads, int64_t kv_heads, int64_t head_dim,
       std::map<std::string, double> opts)
      : keep_(std::move(tensors)), scales_(std::move(scales)), embed_(embed), pos_embed_(pos_embed), head_t_(head),
        inv_freq_(inv_freq.contiguous()), inv_freq_local_(inv_freq_local.contiguous()), H_(heads), K_(kv_heads),
        D_(head_dim) {
    const size_t L = windows.size();
    TORCH_CHECK(keep_.size() == L * kPerLayer && softcaps.size() == L && local_rope.size() == L,
                "Step: tensors, windows, soft-caps and RoPE tables per layer");
    TORCH_CHECK(final_norm.size() == 2, "Step: final_norm is [weight, bias]");
    TORCH_CHECK(scales_.size() == L * kLinearsPerLayer + 1, "Step: scales for 7 linears per layer and the head");
    TORCH_CHECK(opts.size() == std::size(kOpts), "Step: options must be exactly ", std::size(kOpts), " keys");
    auto opt = [&](const char* key) {
      auto it = opts.find(key);
      TORCH_CHECK(it != opts.end(), "Step: option ", key, " is missing");
      return it->second;
    };
    norm_.eps = static_cast<float>(opt("eps"));
    norm_.offset = static_cast<float>(opt("norm_offset"));
    norm_.layer = opt("layer_norm") != 0.0;
    scale_ = static_cast<float>(opt("scale"));
    act_ = static_cast<int64_t>(opt("act"));
    TORCH_CHECK(act_ == kSilu || act_ == kGelu || act_ == kGeluTanh, "Step: act must be 0, 1 or 2");
    qk_full_ = opt("qk_full_width") != 0.0;
    parallel_ = opt("parallel_residual") != 0.0;
    embed_scale_ = static_cast<float>(opt("embed_scale"));
    final_cap_ = static_cast<float>(opt("final_softcap"));
    TORCH_CHECK(!inv_freq_local_.numel() || inv_freq_local_.numel() == inv_freq_.numel(),
                "Step: the two RoPE tables must rotate the same channels");
    C_ = embed.size(1);
    V_ = head.size(0);
    TORCH_CHECK(!pos_embed_.numel() || (pos_embed_.dim() == 2 && pos_embed_.size(1) == C_),
                "Step: pos_embed must be (positions, ", C_, ")");
    keep_.insert(keep_.end(), final_norm.begin(), final_norm.end());
    auto f = [&](size_t i) -> const float* { return keep_[i].numel() ? keep_[i].data_ptr<float>() : nullptr; };
    final_ = Norm{f(L * kPerLayer), f(L * kPerLayer + 1)};
    for (size_t l = 0; l < L; ++l) {
      auto t = [&](int i) -> const torch::Tensor& { return keep_[l * kPerLayer + i]; };
      auto lin = [&](int iw, int ib, int j, int64_t in, const char* what) {
        return make_linear(t(iw), f(l * kPerLayer + ib), scales_[l * kLinearsPerLayer + j], in, what);
      };
      auto nrm = [&](int iw) { return Norm{f(l * kPerLayer + iw), f(l * kPerLayer + iw + 1)}; };
      Layer Ly;
      Ly.attn_norm = nrm(0);
      Ly.q = lin(2, 3, 0, C_, "q"); Ly.k = lin(4, 5, 1, C_, "k"); Ly.v = lin(6, 7, 2, C_, "v");
      Ly.o = lin(8, 9, 3, H_ * D_, "o");
      Ly.q_norm = nrm(10); Ly.k_norm = nrm(12); Ly.attn_post = nrm(14); Ly.mlp_norm = nrm(16);
      Ly.gate = lin(18, 19, 4, C_, "gate"); Ly.up = lin(20, 21, 5, C_, "up");
      Ly.down = lin(22, 23, 6, Ly.up.n, "down");
      Ly.mlp_post = nrm(24);
      Ly.window = windows[l];
      Ly.softcap = static_cast<float>(softcaps[l]);
      Ly.local_rope = local_rope[l];
      TORCH_CHECK(!Ly.local_rope || inv_freq_local_.numel(), "Step: layer ", l, " asks for a local RoPE table");
      split_ = split_ || parallel_ || Ly.attn_post.w || Ly.mlp_post.w;
      layers_.push_back(Ly);
    }
    I_ = layers_.empty() ? 0 : layers_[0].up.n;
    head_ = make_linear(head, nullptr, scales_.back(), C_, "head");
    std::vector<Linear*> linears;  // every linear once: the layers', then the head
    for (Layer& Ly : layers_)
      for (Linear* Li : {&Ly.q, &Ly.k, &Ly.v, &Ly.o, &Ly.gate, &Ly.up, &Ly.down}) linears.push_back(Li);
    linears.push_back(&head_);
    // Weights past kStreamBytes cannot stay in the last-level cache between tokens: every product streams them.
    auto stored = [](const Linear& Li) { return Li.w ? Li.n * Li.ldw * (Li.kind == kF32 ? 4 : Li.kind == kBf16 ? 2 : 1) : 0; };
    int64_t bytes = 0;
    for (const Linear* Li : linears) bytes += stored(*Li);
    const bool far = bytes >= kStreamBytes;
    int64_t group = 0;  // the int4 linears' one group size: q4_input's sums serve every linear with the same input
    for (const Linear* Li : linears) {
      TORCH_CHECK(Li->kind != kInt4 || !group || Li->group == group, "Step: int4 linears of one group size only");
      if (Li->kind == kInt4) group = Li->group;
    }
    const bool idot = opt("int4_dot") != 0.0, idot8 = opt("int8_dot") != 0.0;  // (int8: q8t.h)
    const bool bdot = opt("bf16_dot") != 0.0, rows = opt("decode_rows") != 0.0;
    TORCH_CHECK(!bdot || has_bf16_dot(), "Step: bf16_dot needs a build with AVX512_BF16 (this CPU lacks it)");
    // The integer dots' tiles: a copy of each int4 linear's codes, interleaved (q4t.h), and of each int8 one's,
    // interleaved and biased (q8t.h), each linear's once (the head was once packed per layer, each copy kept:
    // 4.3 GB more for an int8 Qwen3-0.6B shape).
    for (Linear* Li : linears) {
      Li->far = far, Li->idot = Li->kind == kInt8 ? idot8 : idot, Li->bdot = bdot, Li->rows = rows;
      if (idot && kQ4Rows && Li->kind == kInt4) tiles_.push_back(q4t_pack(*Li));
      if (idot8 && kQ8Rows && Li->kind == kInt8) tiles_.push_back(q8t_pack(*Li));
    }
  }

  torch::Tensor run(torch::Tensor tokens, torch::Tensor positions, torch::Tensor kc, torch::Tensor vc, bool hidden,
                    c10::optional<torch::Tensor> block_table, c10::optional<torch::Tensor> counters);

  // Bytes of the step's own copies of weights (the integer dots' tiles), beside the module's tensors.
  int64_t tile_bytes() const {
    int64_t n = 0;
    for (const torch::Tensor& t : tiles_) n += t.defined() ? t.nbytes() : 0;
    return n;
  }

 private:
  std::vector<torch::Tensor> keep_, scales_;  // hold the tensors alive; the pointers below point into them
  torch::Tensor embed_, pos_embed_, head_t_, inv_freq_, inv_freq_local_;
  std::vector<Layer> layers_;
  std::vector<torch::Tensor> tiles_;  // the int4 and int8 linears' codes in tiles (q4t_pack, q8t_pack): their wt
  Linear head_;
  Norm final_;
  NormKind norm_;
  int64_t H_, K_, D_, C_ = 0, V_ = 0, I_ = 0, act_ = kSilu;
  float scale_ = 1.f, embed_scale_ = 0.f, final_cap_ = 0.f;  // 0: no embedding scale, no logit soft-cap
  bool qk_full_ = false, parallel_ = false;
  bool split_ = false;  // some branch output is normed or added later, so it needs its own buffer
};

torch::Tensor Step::run(torch::Tensor tokens, torch::Tensor positions, torch::Tensor kc, torch::Tensor vc,
                        bool hidden, c10::optional<torch::Tensor> block_table,
                        c10::optional<torch::Tensor> counters) {
  TORCH_CHECK(tokens.dim() == 2 && positions.sizes() == tokens.sizes(), "step: tokens and positions (B, T)");
  const int64_t B = tokens.size(0), T = tokens.size(1), M = B * T, L = layers_.size();
  const bool paged = block_table.has_value() && block_table->defined();
  TORCH_CHECK(kc.dim() == 5 && kc.sizes() == vc.sizes() && kc.size(0) == L && (paged || kc.size(1) == B) &&
                  kc.size(2) == K_ && kc.size(4) == D_,
              paged ? "step: cache pool (L, blocks, K, block size, D) for this model"
                    : "step: cache (L, B, K, S, D) for this model and batch");
  TORCH_CHECK((kc.scalar_type() == torch::kFloat32 || kc.scalar_type() == torch::kBFloat16) &&
                  vc.scalar_type() == kc.scalar_type() && kc.device().is_cpu() && vc.device().is_cpu(),
              "step: an fp32 or bf16 CPU cache (keys and values alike)");
  TORCH_CHECK(kc.stride(4) == 1 && vc.stride(4) == 1 && kc.strides() == vc.strides(), "step: cache rows contiguous");
  const int64_t NB = kc.size(1), bs = kc.size(3), half = inv_freq_.numel(), G = H_ / K_, HD = H_ * D_, KD = K_ * D_;
  // Row b's blocks are table[b * nb ...]: the block table's, or the static cache's one block per row.
  int64_t nb = 1;
  std::vector<int64_t> table(B);
  if (paged) {
    const torch::Tensor& bt = *block_table;
    TORCH_CHECK(bt.dim() == 2 && bt.size(0) == B && bt.device().is_cpu(),
                "step: block_table must be a CPU tensor (B, blocks per row) for the ", B, " rows");
    TORCH_CHECK(bt.scalar_type() == torch::kLong || bt.scalar_type() == torch::kInt,
                "step: block_table must be int64 or int32, got ", bt.scalar_type());
    nb = bt.size(1);
    auto bt64 = bt.to(torch::kLong).contiguous();
    table.assign(bt64.data_ptr<int64_t>(), bt64.data_ptr<int64_t>() + B * nb);
  } else {
    for (int64_t b = 0; b < B; ++b) table[b] = b;
  }
  // Everything is checked before any work, so bad input never reads or writes outside the cache.
  auto tok = tokens.to(torch::kLong).contiguous(), pos = positions.to(torch::kLong).contiguous();
  const int64_t *tp = tok.data_ptr<int64_t>(), *pp = pos.data_ptr<int64_t>();
  std::vector<int64_t> last(B, 0);  // each row's highest position: its slots 0..last are the ones touched
  for (int64_t m = 0; m < M; ++m) {
    if (paged) {
      TORCH_CHECK(0 <= pp[m] && pp[m] < nb * bs, "step: position ", pp[m], " of row ", m / T,
                  " is beyond its block table's ", nb, " blocks of ", bs, " slots");
    } else {
      TORCH_CHECK(0 <= pp[m] && pp[m] < bs, "step: position ", pp[m], " outside the cache's ", bs, " slots");
    }
    TORCH_CHECK(0 <= tp[m] && tp[m] < embed_.size(0), "step: token id ", tp[m], " outside the vocabulary");
    TORCH_CHECK(!pos_embed_.numel() || pp[m] < pos_embed_.size(0), "step: position ", pp[m], " is past the model's ",
                pos_embed_.size(0), " learned positions");
    last[m / T] = std::max(last[m / T], pp[m]);
  }
  // Only the entries a row reaches are block ids: those past its last position are never read, so a
  // scheduler may pad a short row's table with anything (-1, say).
  for (int64_t b = 0; b < B && T > 0; ++b)
    for (int64_t j = 0; j <= last[b] / bs; ++j)
      TORCH_CHECK(0 <= table[b * nb + j] && table[b * nb + j] < NB, "step: block_table[", b, "][", j, "] = ",
                  table[b * nb + j], " is not a block of the pool's ", NB);
  auto out = torch::empty({B, T, hidden ? C_ : V_}, torch::kFloat32);
  if (M == 0) return out;
  const int64_t span = *std::max_element(last.begin(), last.end()) + 1;  // attention scores per query, at most
  const int64_t groups = (T + kQueryGroup - 1) / kQueryGroup;  // attention's token groups per row
  const int nth = std::max(1, at::get_num_threads());
  // Scratch, fp32: residual x, normed h (one copy per thread), q, k|v, attention out, the MLP's act, cos|sin
  // (a second table after the first for local RoPE), scores per thread, and the branches' outputs where a
  // branch is normed or added later.
  const int64_t tables = inv_freq_local_.numel() ? 2 : 1;
  Scratch x(M * C_), h(nth * M * C_), q(M * HD), kv(M * 2 * KD), att(M * HD), act(M * I_),
      glu(nth * 2 * M * kBlock), cs(tables * M * 2 * half), scores(nth * kQueryGroup * G * span), ao(split_ ? M * C_ : 0),
      mo(split_ ? M * C_ : 0);
  // The cache's slots (store_slot): fp32 or bf16, one of each pair null. Strides count elements either way.
  const bool kv16 = kc.scalar_type() == torch::kBFloat16;
  float *kp = kv16 ? nullptr : kc.data_ptr<float>(), *vp = kv16 ? nullptr : vc.data_ptr<float>();
  bf16 *kp16 = kv16 ? kc.data_ptr<bf16>() : nullptr, *vp16 = kv16 ? vc.data_ptr<bf16>() : nullptr;
  auto store = [&](const float* xh, bool is_k, int64_t off) {
    if (kv16) store_slot(xh, D_, (is_k ? kp16 : vp16) + off);
    else store_slot(xh, D_, (is_k ? kp : vp) + off);
  };
  const int64_t sL = kc.stride(0), sBlock = kc.stride(1), sK = kc.stride(2), sS = kc.stride(3);
  const float* invs[2] = {inv_freq_.data_ptr<float>(), tables == 2 ? inv_freq_local_.data_ptr<float>() : nullptr};
  const bool emb16 = embed_.scalar_type() == torch::kBFloat16;
  const float* e32 = emb16 ? nullptr : embed_.data_ptr<float>();
  const bf16* e16 = emb16 ? embed_.data_ptr<bf16>() : nullptr;
  const bool pos16 = pos_embed_.numel() && pos_embed_.scalar_type() == torch::kBFloat16;
  const float* p32 = pos_embed_.numel() && !pos16 ? pos_embed_.data_ptr<float>() : nullptr;
  const bf16* p16 = pos16 ? pos_embed_.data_ptr<bf16>() : nullptr;
  const NormKind& norm = norm_;
  // Phase timing (`sluice profile`): thread 0 adds the time since its last mark to a phase at each boundary.
  // Most phases end at a barrier, so that is the phase's wall time; without counters each mark is one branch.
  double* ct = nullptr;
  if (counters.has_value() && counters->defined()) {
    const torch::Tensor& c = *counters;
    TORCH_CHECK(c.scalar_type() == torch::kFloat64 && c.is_contiguous() && c.numel() == kPhases && c.device().is_cpu(),
                "step: counters must be a contiguous CPU float64 tensor of ", kPhases);
    ct = counters->data_ptr<double>();
  }
  double marked = ct ? omp_get_wtime() : 0.0;  // thread 0's last mark

#pragma omp parallel num_threads(nth)
  {
    float* sc = scores.data() + omp_get_thread_num() * kQueryGroup * G * span;
    std::vector<const float*> qv(kQueryGroup * G);  // attention's pairs (query head, token) of one pass
    std::vector<float*> ov(kQueryGroup * G);
    std::vector<int64_t> los(kQueryGroup * G), ps(kQueryGroup * G);
    float* tmp = glu.data() + omp_get_thread_num() * 2 * M * kBlock;
    // Each thread norms every row into its own copy of h: a few us of redundant work instead of a
    // barrier before each product (a barrier costs a time slice when the other core is busy).
    float* hn = h.data() + omp_get_thread_num() * M * C_;
    auto norm_rows = [&](const Norm& N) { norm(N, x.data(), C_, C_, M, hn, C_); };
    const bool marks = ct && omp_get_thread_num() == 0;
    auto mark = [&](Phase phase) {
      if (marks) {
        const double now = omp_get_wtime();
        ct[phase] += now - marked;
        marked = now;
      }
    };
    // A branch's output y (ao or mo) after its post-norm goes into the residual: x + y, or with NeoX's
    // parallel residual x + (mlp + attn), torch's order of additions. 16 rows per item, as rms_norm_rows sums.
    auto add_branch = [&](const Norm& post, float* y, bool both) {
#pragma omp for schedule(static)
      for (int64_t m0 = 0; m0 < M; m0 += 16) {
        const int64_t n = std::min<int64_t>(16, M - m0);
        norm(post, &y[m0 * C_], C_, C_, n, &y[m0 * C_], C_);
        for (int64_t i = m0 * C_; i < (m0 + n) * C_; ++i) x[i] += both ? y[i] + ao[i] : y[i];
      }
    };
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) {
      const int64_t row = tp[m] * C_;
      for (int64_t c = 0; c < C_; ++c)
        x[m * C_ + c] = emb16 ? widen(e16[row + c]) : e32[row + c];
      if (embed_scale_ != 0.f)  // Gemma: the scale rounded to fp32, as torch multiplies it
        for (int64_t c = 0; c < C_; ++c) x[m * C_ + c] *= embed_scale_;
      if (p32 || p16)  // learned positions (GPT-2): x + pos_embed[position]
        for (int64_t c = 0; c < C_; ++c) x[m * C_ + c] += p16 ? widen(p16[pp[m] * C_ + c]) : p32[pp[m] * C_ + c];
      const float p = static_cast<float>(pp[m]);  // the angle in fp32, as rope_tables computes it
      for (int64_t t = 0; t < tables; ++t)
        for (int64_t i = 0; i < half; ++i) {
          const float a = p * invs[t][i];
          cs[(t * M + m) * 2 * half + i] = std::cos(a);
          cs[(t * M + m) * 2 * half + half + i] = std::sin(a);
        }
    }
    mark(kEmbedding);
    for (int64_t l = 0; l < L; ++l) {
      const Layer& Ly = layers_[l];
      const float* cst = cs.data() + (Ly.local_rope ? M * 2 * half : 0);  // row m's cos at cst + m * 2 * half
      norm_rows(Ly.attn_norm);
      mark(kNorms);
      // q, k and v one head at a time: item j < H is query head j, then the K key heads, then the K value
      // heads. The thread that computes a head's D outputs also norms and rotates them (qk-norm, RoPE) and
      // stores new keys and values in their cache slot, so no barrier is needed between the two. Dynamic:
      // the items are few and unequal (v heads have no norm or RoPE), and a core may be slowed (see linear).
      // A full-width qk-norm (OLMo 2) needs every head of the row first: those rows are finished below.
      const Linear* l4 = takes_codes(Ly.q) ? &Ly.q : takes_codes(Ly.k) ? &Ly.k : takes_codes(Ly.v) ? &Ly.v : nullptr;
      const Q4In q4 = l4 ? codes_input(*l4, hn, M) : Q4In{};  // (one group size for the model: the same for all three)
      b16_prepare(Ly.q.kind == kBf16 ? Ly.q : Ly.k.kind == kBf16 ? Ly.k : Ly.v, hn, M);  // (q, k, v: one input)
#pragma omp for schedule(dynamic)
      for (int64_t j = 0; j < H_ + 2 * K_; ++j) {
        const bool is_q = j < H_, is_k = !is_q && j < H_ + K_;
        const int64_t hh = is_q ? j : is_k ? j - H_ : j - H_ - K_, ld = is_q ? HD : 2 * KD;
        float* y = is_q ? &q[hh * D_] : &kv[(is_k ? 0 : KD) + hh * D_];  // row m's head at y + m * ld
        block(is_q ? Ly.q : is_k ? Ly.k : Ly.v, hn, q4, M, hh * D_, (hh + 1) * D_, y, ld, false);
        if (qk_full_ && (is_q || is_k)) continue;
        const Norm* qk = is_q ? &Ly.q_norm : is_k ? &Ly.k_norm : nullptr;
        if (qk && qk->w) norm(*qk, y, ld, D_, M, y, ld);
        for (int64_t m = 0; m < M; ++m) {
          float* xh = y + m * ld;
          const int64_t p = pp[m];
          if (is_q || is_k) rope(xh, &cst[m * 2 * half], &cst[m * 2 * half + half], half);
          if (!is_q)
            store(xh, is_k, l * sL + table[m / T * nb + p / bs] * sBlock + hh * sK + (p % bs) * sS);
        }
      }
      if (qk_full_) {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) {
          float *qm = &q[m * HD], *km = &kv[m * 2 * KD];
          const int64_t p = pp[m];
          norm(Ly.q_norm, qm, HD, HD, 1, qm, HD);
          norm(Ly.k_norm, km, KD, KD, 1, km, KD);
          for (int64_t hh = 0; hh < H_ + K_; ++hh) {
            float* xh = hh < H_ ? qm + hh * D_ : km + (hh - H_) * D_;
            rope(xh, &cst[m * 2 * half], &cst[m * 2 * half + half], half);
            if (hh >= H_) store(xh, true, l * sL + table[m / T * nb + p / bs] * sBlock + (hh - H_) * sK + (p % bs) * sS);
          }
        }
      }
      mark(kQkv);  // with the qk-norms, RoPE and the cache writes
      // Attention of each token's query heads over its row's slots <= position (and inside the window), one
      // item per KV head and group of up to kQueryGroup tokens of a row: one pass over the head's keys and values
      // serves the G query heads of each of those tokens (attend). Only tokens at consecutive positions share a
      // pass, so the slots one reads beyond its own are the next ones' own, written above. Items run head by
      // head (all of a KV head's rows and groups, then the next head's) and are dealt round-robin: a thread's
      // next item reads the keys and values its last one read, from its core's L2, where head-minor order read
      // the other heads' in between and missed it (scores ran ~20% faster on a Zen 5 at 512 tokens), and each
      // thread gets a share of every head, row and position (rows differ in length; later tokens cost more).
#pragma omp for schedule(static, 1)
      for (int64_t i = 0; i < B * groups * K_; ++i) {
        const int64_t g = i / (B * groups), b = i % (B * groups) / groups, t0 = i % groups * kQueryGroup;
        const int64_t t1 = std::min(T, t0 + kQueryGroup);
        const int64_t head = l * sL + g * sK;  // this KV head's slot 0 in block 0; blocks add their offset
        for (int64_t t = t0; t < t1;) {
          int64_t n = 1;  // tokens t .. t + n - 1 at consecutive positions
          while (t + n < t1 && pp[b * T + t + n] == pp[b * T + t + n - 1] + 1) ++n;
          for (int64_t j = 0; j < n * G; ++j) {
            const int64_t m = b * T + t + j / G, hq = g * G + j % G, p = pp[m];
            qv[j] = &q[m * HD + hq * D_];
            ov[j] = &att[m * HD + hq * D_];
            ps[j] = p;
            los[j] = Ly.window ? std::max<int64_t>(0, p - Ly.window + 1) : 0;
          }
          if (kv16)
            attend(qv.data(), ov.data(), los.data(), ps.data(), n * G, kp16 + head, vp16 + head, &table[b * nb], bs,
                   sBlock, sS, D_, scale_, Ly.softcap, sc, span);
          else
            attend(qv.data(), ov.data(), los.data(), ps.data(), n * G, kp + head, vp + head, &table[b * nb], bs,
                   sBlock, sS, D_, scale_, Ly.softcap, sc, span);
          t += n;
        }
      }
      mark(kAttention);
      // A pre-norm branch adds straight into x; one with a post-norm, or NeoX's parallel pair, goes to its own
      // buffer first.
      const bool attn_apart = parallel_ || Ly.attn_post.w, mlp_apart = parallel_ || Ly.mlp_post.w;
      linear(Ly.o, att.data(), M, attn_apart ? ao.data() : x.data(), C_, !attn_apart);  // x + o(attn)
#pragma omp barrier
      mark(kO);
      if (attn_apart && !parallel_) add_branch(Ly.attn_post, ao.data(), false);
      else if (Ly.attn_post.w) {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; ++m) norm(Ly.attn_post, &ao[m * C_], C_, C_, 1, &ao[m * C_], C_);
      }
      norm_rows(Ly.mlp_norm);  // parallel: x is still the block's input
      mark(kNorms);
      mlp_act(Ly.gate, Ly.up, act_, hn, M, act.data(), tmp);
#pragma omp barrier
      linear(Ly.down, act.data(), M, mlp_apart ? mo.data() : x.data(), C_, !mlp_apart);  // x + down(act)
#pragma omp barrier
      mark(kMlp);
      if (mlp_apart) add_branch(Ly.mlp_post, mo.data(), parallel_);
      mark(kNorms);
    }
    if (hidden) {
#pragma omp for schedule(static)
      for (int64_t m0 = 0; m0 < M; m0 += 16) {  // 16 rows per item: rms_norm_rows sums 16 at once
        float* dst = out.data_ptr<float>() + m0 * C_;
        norm(final_, &x[m0 * C_], C_, C_, std::min<int64_t>(16, M - m0), dst, C_);
      }
      mark(kFinalNorm);
    } else {
      norm_rows(final_);
      mark(kFinalNorm);
      linear(head_, hn, M, out.data_ptr<float>(), V_);
      if (final_cap_ != 0.f) {
        float* o = out.data_ptr<float>();
#pragma omp barrier
        constexpr int64_t kPiece = 4096;  // a multiple of 16: a logit's form depends on its vocabulary index only
        const int64_t pieces = (V_ + kPiece - 1) / kPiece;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M * pieces; ++i) {
          const int64_t v0 = i % pieces * kPiece;
          soft_cap_n(o + i / pieces * V_ + v0, std::min(kPiece, V_ - v0), final_cap_);
        }
      }
    }
  }  // the region's end waits for every thread: the head's wall time
  if (ct) ct[hidden ? kFinalNorm : kHead] += omp_get_wtime() - marked;
  return out;
}

}  // namespace

// A draft model's guesses for a speculative round in one call: the loop of proposers.DraftProposer (its
// usual round, every row reading its last two tokens), with no Python between the guesses. Included here,
// after the step's code, so draw.h's fp-contract setting (the race's and the filters' float order) reaches
// only what follows.
#include "draw.h"

namespace {

// Step.guess: rows reading their last two tokens, last_two[2b], last_two[2b + 1], at positions start[b],
// start[b] + 1, then one guess at a time, row b making caps[b] >= 1 guesses (a row stops reading once it has
// its own), each drawn by draw.h's propose_row (the row's temperature, 0 on a greedy row; a sampled row races
// with its stream at keys[b], draws[b] + j for guess j). tables[b]: the row's block ids (padded as PagedView
// pads them). Every forward is the one proposers.py runs for the same rows (the same tokens, positions, block
// table rows, batch), so the same logits, the same cache writes, the same guesses. Plain lists in and out: a
// round's Python is a few list builds, no tensors. Returns (each row's guesses, q (B, K, V) fp32: each guess's
// distribution (empty with want_q false), deferred): on deferred (a non-finite logit, a race the bound cannot
// settle) nothing is returned but the cache writes, which the caller's own loop makes again with the same values.
std::tuple<std::vector<std::vector<int64_t>>, torch::Tensor, bool> guess(
    Step& step, const std::vector<int64_t>& last_two, const std::vector<int64_t>& start, torch::Tensor kc,
    torch::Tensor vc, const std::vector<std::vector<int64_t>>& tables, const std::vector<int64_t>& caps,
    const std::vector<float>& temperature, const std::vector<bool>& sampled, const std::vector<uint64_t>& keys,
    const std::vector<int64_t>& draws, bool want_q, int64_t W) {
  const int64_t B = start.size();
  TORCH_CHECK(B > 0 && static_cast<int64_t>(last_two.size()) == 2 * B && static_cast<int64_t>(tables.size()) == B &&
                  static_cast<int64_t>(caps.size()) == B && static_cast<int64_t>(temperature.size()) == B &&
                  static_cast<int64_t>(sampled.size()) == B && static_cast<int64_t>(keys.size()) == B &&
                  static_cast<int64_t>(draws.size()) == B && (W == 8 || W == 16),
              "guess: two tokens, a start, a block table, a cap, a temperature, a sampled flag and a stream a row; "
              "W 8 or 16");
  int64_t K = 0, nb = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(caps[b] >= 1, "guess: every row makes at least one guess");
    TORCH_CHECK(!tables[b].empty(), "guess: every row has a block");
    K = std::max(K, caps[b]);
    nb = std::max(nb, static_cast<int64_t>(tables[b].size()));
  }
  auto block_table = torch::empty({B, nb}, torch::kInt64);
  for (int64_t b = 0; b < B; ++b) {
    int64_t* row = block_table.data_ptr<int64_t>() + b * nb;
    std::copy(tables[b].begin(), tables[b].end(), row);
    std::fill(row + tables[b].size(), row + nb, tables[b][0]);
  }
  const int64_t* sp = start.data();
  const int64_t* capp = caps.data();
  const float* tp = temperature.data();
  auto first = torch::from_blob(const_cast<int64_t*>(last_two.data()), {B, 2}, torch::kInt64);
  auto st = torch::from_blob(const_cast<int64_t*>(start.data()), {B}, torch::kInt64);
  std::vector<int64_t> tok(B * K, 0);  // tok[b * K + j]: row b's guess j
  torch::Tensor logits = step.run(first, torch::stack({st, st + 1}, 1), kc, vc, false, block_table, c10::nullopt);
  const int64_t V = logits.size(2);
  auto q = want_q ? torch::zeros({B, K, V}, torch::kFloat32) : torch::empty({0}, torch::kFloat32);
  std::vector<float> one_q(want_q ? 0 : V);  // a greedy batch's q is not kept: one row of scratch
  sluice_spec::Nucleus scratch;
  std::vector<sluice_draw::Rival> rivals;
  std::vector<int64_t> alive(B);
  for (int64_t b = 0; b < B; ++b) alive[b] = b;
  const float* x = logits.data_ptr<float>() + V;  // row a of the alive rows at x + a * stride
  int64_t stride = 2 * V;
  for (int64_t j = 0; j < K; ++j) {
    if (j) {
      std::vector<int64_t> next;
      for (int64_t b : alive)
        if (capp[b] > j) next.push_back(b);
      if (next.empty()) break;
      const int64_t A = next.size();
      auto t = torch::empty({A, 1}, torch::kInt64), p = torch::empty({A, 1}, torch::kInt64);
      for (int64_t a = 0; a < A; ++a) {
        t.data_ptr<int64_t>()[a] = tok[next[a] * K + j - 1];
        p.data_ptr<int64_t>()[a] = sp[next[a]] + 1 + j;
      }
      torch::Tensor table = block_table;
      if (A < B) table = block_table.index_select(0, torch::tensor(next, torch::kInt64));
      logits = step.run(t, p, kc, vc, false, table, c10::nullopt);
      x = logits.data_ptr<float>(), stride = V;
      alive.swap(next);
    }
    for (size_t a = 0; a < alive.size(); ++a) {
      const int64_t b = alive[a];
      float* d = want_q ? q.data_ptr<float>() + (b * K + j) * V : one_q.data();
      if (!want_q) std::fill(one_q.begin(), one_q.end(), 0.f);
      const int64_t t = sluice_draw::propose_row(x + a * stride, V, tp[b], sampled[b], keys[b], draws[b] + j,
                                                 static_cast<int>(W), d, scratch, rivals);
      if (t < 0) return {{}, q, true};
      tok[b * K + j] = t;
    }
  }
  std::vector<std::vector<int64_t>> out(B);
  for (int64_t b = 0; b < B; ++b) out[b].assign(tok.begin() + b * K, tok.begin() + b * K + capp[b]);
  return {out, q, false};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_avx2", &has_avx2, "whether this build has the AVX2 + FMA paths");
  m.def("has_avx512", &has_avx512, "whether this build's products run on the AVX-512 tiles");
  m.def("has_bf16_dot", &has_bf16_dot, "whether this build has the bf16 dot mode (AVX512_BF16)");
  pybind11::class_<Step>(m, "Step")
      .def(pybind11::init<std::vector<torch::Tensor>, torch::Tensor, torch::Tensor, std::vector<torch::Tensor>,
                          torch::Tensor, std::vector<torch::Tensor>, torch::Tensor, torch::Tensor,
                          std::vector<int64_t>, std::vector<double>,
                          std::vector<bool>, int64_t, int64_t, int64_t, std::map<std::string, double>>())
      .def("run", &Step::run,
           "tokens (B, T), positions (B, T), k, v cache (L, B, K, S, D) or pool (L, NB, K, bs, D), hidden, "
           "block_table (B, nb) or None, counters (8,) float64 or None: seconds per phase added -> (B, T, V|C)",
           pybind11::arg("tokens"), pybind11::arg("positions"), pybind11::arg("k"), pybind11::arg("v"),
           pybind11::arg("hidden"), pybind11::arg("block_table") = pybind11::none(),
           pybind11::arg("counters") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("guess", &guess,
           "a draft's guesses for a speculative round: last_two (2B), start (B), k, v pool, block tables, caps (B), "
           "temperature (B), sampled (B), keys, draws, want_q, W -> (guesses per row, q (B, K, V) or empty, deferred)",
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("tile_bytes", &Step::tile_bytes, "bytes of the integer dots' tiles: the step's own copy of int4/int8 codes");
}
