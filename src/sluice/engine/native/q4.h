// step.cpp's int4 products (model/quant.py's Int4Linear). A part of step.cpp kept apart for length: it is
// included inside step.cpp's namespace, after Linear, Prefetch, put16/put4, reduce16 and Scratch, and uses them.
//
// The weights are quant.py's nibble layout: a row is K' / 2 bytes, and in each block of 32 inputs (16 bytes)
// byte j holds the code of input j in its low nibble and of input j + 16 in its high one, q in [0, 15]. Each
// group of `group` inputs (a multiple of 32) has a bf16 scale s and zero z, read in place from the module's
// scales_zeros (G, N', 2): w = (q - 8) s + z. Per group a product sums acc = sum_k x_k q_k (codes widened to
// fp32 in registers, exact), then adds s acc + c xsum, with c = z - 8 s (one rounding) and xsum the sum of
// x over the group: the product with the dequantized weight up to the order of the sums, at two FMAs per
// group instead of a multiply per weight. xsum is kept as a vector of lanes that sum to it (Q4In), so it is
// added lane by lane and the row's one horizontal sum at the end covers it too.
//
// A token's numbers do not depend on its batch or chunk: every (weight row, token row) pair runs the same
// operations in the same order whatever the tile shape, and a prefill pass that widens the codes into an fp32
// scratch first (as block() does for bf16) reads the same code values.

#ifdef SLUICE_AVX512
constexpr int64_t kQ4Lanes = 16;
#elif defined(SLUICE_AVX2)
constexpr int64_t kQ4Lanes = 8;
#else
constexpr int64_t kQ4Lanes = 1;
#endif
constexpr int64_t kQ4Block = 32;  // inputs per block of the nibble layout

// An int4 product's input: the activation rows zero-padded to K' (x itself when K = K'), and per row and group
// kQ4Lanes floats whose sum is the group's sum of x (lane l: the group's inputs l, l + kQ4Lanes, ... in order).
struct Q4In {
  const float* x = nullptr;
  int64_t ldx = 0;
  const float* xs = nullptr;
  int64_t ldxs = 0;
  // The integer-dot mode's input (q4i.h), set instead of xs: int8 codes (M, K'), per row the blocks' scales d
  // (nb = K' / 32 each) and the groups' sums of d * sum(a) (ng = K' / group each).
  const int8_t* a = nullptr;
  float* d = nullptr;
  float* dsum = nullptr;
  int64_t nb = 0, ng = 0;
  const int32_t* c = nullptr;  // int8 weights' integer dot (q8t.h, instead of dsum): per row and block, -128 sum(a)
};


// Group g's scale s and c = z - 8 s for R weight rows (rows[r]), as fp32 into s[0:R], c[0:R]. R consecutive rows
// (run) load as one vector; the scalar form rounds c the same way (one fma), so both give the same bits.
template <int R>
inline void q4_scales(const Linear& L, int64_t g, const int64_t* rows, bool run, float* s, float* c) {
  const bf16* p = L.sz + 2 * g * L.ldsz;
#ifdef SLUICE_AVX512
  if constexpr (R == 16) {
    if (run) {  // the 16 rows' (s, z) pairs are one cache line: s the low bf16 of each 32 bits, z the high
      const __m512i v = _mm512_loadu_si512(p + 2 * rows[0]);
      const __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      const __m512 zv = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
      _mm512_store_ps(s, sv);
      _mm512_store_ps(c, _mm512_fnmadd_ps(_mm512_set1_ps(8.f), sv, zv));
      return;
    }
  }
#endif
#ifdef SLUICE_AVX2
  if constexpr (R == 4) {
    if (run) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * rows[0]));
      const __m128 sv = _mm_castsi128_ps(_mm_slli_epi32(v, 16));
      const __m128 zv = _mm_castsi128_ps(_mm_and_si128(v, _mm_set1_epi32(static_cast<int>(0xFFFF0000u))));
      _mm_store_ps(s, sv);
      _mm_store_ps(c, _mm_fnmadd_ps(_mm_set1_ps(8.f), sv, zv));
      return;
    }
  }
#endif
  for (int r = 0; r < R; ++r) {
    s[r] = widen(p[2 * rows[r]]);
    c[r] = std::fma(-8.f, s[r], widen(p[2 * rows[r] + 1]));
  }
}

#include "q4i.h"

// The Q4In of L's input x (M rows of L.k floats), in this thread's buffers: valid until the thread's next call.
// Each thread makes its own (it is M * K' additions, a small part of the product), so no barrier is needed.
inline Q4In q4_input(const Linear& L, const float* x, int64_t M) {
  static thread_local Scratch pad, sums;
  const int64_t K = L.k, Kp = 2 * L.ldw, gs = L.group, G = Kp / gs;
  Q4In in;
  in.x = x;
  in.ldx = Kp;
  if (Kp != K) {
    if (static_cast<int64_t>(pad.size()) < M * Kp) pad.resize(M * Kp);
    for (int64_t m = 0; m < M; ++m) {
      std::copy(x + m * K, x + (m + 1) * K, pad.data() + m * Kp);
      std::fill(pad.data() + m * Kp + K, pad.data() + (m + 1) * Kp, 0.f);
    }
    in.x = pad.data();
  }
  if (L.idot) {
    q4i_quantize(gs, in.x, in.ldx, M, Kp, in);
    return in;
  }
  in.ldxs = G * kQ4Lanes;
  if (static_cast<int64_t>(sums.size()) < M * in.ldxs) sums.resize(M * in.ldxs);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = in.x + m * Kp + g * gs;
      float* out = sums.data() + m * in.ldxs + g * kQ4Lanes;
#ifdef SLUICE_AVX512
      __m512 v = _mm512_loadu_ps(xg);
      for (int64_t j = 16; j < gs; j += 16) v = _mm512_add_ps(v, _mm512_loadu_ps(xg + j));
      _mm512_storeu_ps(out, v);
#elif defined(SLUICE_AVX2)
      __m256 v = _mm256_loadu_ps(xg);
      for (int64_t j = 8; j < gs; j += 8) v = _mm256_add_ps(v, _mm256_loadu_ps(xg + j));
      _mm256_storeu_ps(out, v);
#else
      float v = 0.f;
      for (int64_t j = 0; j < gs; ++j) v += xg[j];
      *out = v;
#endif
    }
  in.xs = sums.data();
  return in;
}

// The codes of a row from k on, as fp32: what a prefill pass's tiles read instead of the nibbles (same values).
inline void q4_widen_row(const uint8_t* w, int64_t Kp, float* out) {
  for (int64_t k = 0; k < Kp; k += kQ4Block)
    for (int64_t j = 0; j < kQ4Block / 2; ++j) {
      out[k + j] = static_cast<float>(w[k / 2 + j] & 15);
      out[k + j + kQ4Block / 2] = static_cast<float>(w[k / 2 + j] >> 4);
    }
}

#ifdef SLUICE_AVX512
// The 32 codes of the block at input k: inputs k .. k + 15 (lo) and k + 16 .. k + 31 (hi), in fp32.
inline void q4_load(const uint8_t* w, int64_t k, __m512& lo, __m512& hi) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k / 2)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}
inline void q4_load(const float* w, int64_t k, __m512& lo, __m512& hi) {  // codes widened by q4_widen_row
  lo = _mm512_loadu_ps(w + k);
  hi = _mm512_loadu_ps(w + k + 16);
}

// The sums of R weight rows x MT activation rows (x, xs: row m0's in a Q4In) in one vector at lane m * R + r, as
// tile() returns them, for groups of GS inputs. pf: per_step lines prefetched per group (into L2 with t1, else L1).
// The group size is a template argument so that the loops over a group and over the rows unroll, and the R * MT
// sums stay in registers (with a run-time size they lived on the stack: 3x slower).
template <typename C, int R, int MT, int GS>
inline __m512 q4_tile(const C* const w[R], const int64_t rows[R], bool run, const Linear& L, const Q4In& in,
                      const float* x, const float* xs, Prefetch& pf, bool t1) {
  static_assert(R * MT <= 16, "one reduce16 per tile");
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
  alignas(64) float s[16], c[16];
  const char *pp = pf.p, *const pend = pf.end;
  constexpr int64_t gs = GS;
  const int64_t Kp = in.ldx;
  for (int64_t k0 = 0, g = 0; k0 < Kp; k0 += gs, ++g) {
    if (t1)
      for (int64_t j = 0; j < pf.per_step && pp < pend; ++j, pp += 64) _mm_prefetch(pp, _MM_HINT_T1);
    else
      for (int64_t j = 0; j < pf.per_step && pp < pend; ++j, pp += 64) _mm_prefetch(pp, _MM_HINT_T0);
    q4_scales<R>(L, g, rows, run, s, c);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      __m512 acc[MT];
#pragma GCC unroll 8
      for (int64_t k = k0; k < k0 + gs; k += kQ4Block) {
        __m512 lo, hi;
        q4_load(w[r], k, lo, hi);
        for (int m = 0; m < MT; ++m) {
          const float* xm = x + m * in.ldx + k;
          acc[m] = k == k0 ? _mm512_mul_ps(lo, _mm512_loadu_ps(xm)) : _mm512_fmadd_ps(lo, _mm512_loadu_ps(xm), acc[m]);
          acc[m] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xm + 16), acc[m]);
        }
      }
      const __m512 sv = _mm512_set1_ps(s[r]), cv = _mm512_set1_ps(c[r]);
      for (int m = 0; m < MT; ++m) {
        a[m * R + r] = _mm512_fmadd_ps(sv, acc[m], a[m * R + r]);
        a[m * R + r] = _mm512_fmadd_ps(cv, _mm512_loadu_ps(xs + m * in.ldxs + g * 16), a[m * R + r]);
      }
    }
  }
  pf.p = pp;
  return reduce16(a);
}
#else
// out[r][m] = the product of weight row r with activation row m (x, xs: row 0's in a Q4In), N * M <= 8, each pair's
// operations in the same order whatever N and M. pf: the next rows, one line per block of 32 inputs.
template <int N, int M, int GS>
inline void q4_dot(const uint8_t* const w[N], const int64_t rows[N], bool run, const Linear& L, const Q4In& in,
                   const float* x, const float* xs, float out[4][4], const char* pf = nullptr, bool far = false) {
  alignas(16) float s[4], c[4];
  constexpr int64_t gs = GS;
  const int64_t Kp = in.ldx;
#ifdef SLUICE_AVX2
  __m256 a[N][M];
  for (int r = 0; r < N; ++r)
    for (int m = 0; m < M; ++m) a[r][m] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi32(15);
  for (int64_t k0 = 0, g = 0; k0 < Kp; k0 += gs, ++g) {
    if (pf)
      for (int64_t j = 0; j < gs / kQ4Block; ++j, pf += 64) {
        if (far) _mm_prefetch(pf, _MM_HINT_T1);
        else _mm_prefetch(pf, _MM_HINT_T0);
      }
    q4_scales<N>(L, g, rows, run, s, c);
#pragma GCC unroll 4
    for (int r = 0; r < N; ++r) {
      __m256 acc[M];
#pragma GCC unroll 8
      for (int64_t k = k0; k < k0 + gs; k += kQ4Block) {
        const uint8_t* p = w[r] + k / 2;
        const __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
        const __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
        // inputs k .. k + 7, k + 8 .. 15, k + 16 .. 23, k + 24 .. 31
        const __m256 q[4] = {_mm256_cvtepi32_ps(_mm256_and_si256(v0, low)), _mm256_cvtepi32_ps(_mm256_and_si256(v1, low)),
                             _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4))};
        for (int m = 0; m < M; ++m) {
          const float* xm = x + m * in.ldx + k;
          acc[m] = k == k0 ? _mm256_mul_ps(q[0], _mm256_loadu_ps(xm)) : _mm256_fmadd_ps(q[0], _mm256_loadu_ps(xm), acc[m]);
          for (int i = 1; i < 4; ++i) acc[m] = _mm256_fmadd_ps(q[i], _mm256_loadu_ps(xm + 8 * i), acc[m]);
        }
      }
      const __m256 sv = _mm256_set1_ps(s[r]), cv = _mm256_set1_ps(c[r]);
      for (int m = 0; m < M; ++m) {
        a[r][m] = _mm256_fmadd_ps(sv, acc[m], a[r][m]);
        a[r][m] = _mm256_fmadd_ps(cv, _mm256_loadu_ps(xs + m * in.ldxs + g * 8), a[r][m]);
      }
    }
  }
  for (int r = 0; r < N; ++r)
    for (int m = 0; m < M; ++m) out[r][m] = hsum(a[r][m]);
#else
  (void)pf, (void)far;
  for (int r = 0; r < N; ++r)
    for (int m = 0; m < M; ++m) out[r][m] = 0.f;
  for (int64_t k0 = 0, g = 0; k0 < Kp; k0 += gs, ++g) {
    q4_scales<N>(L, g, rows, run, s, c);
    for (int r = 0; r < N; ++r)
      for (int m = 0; m < M; ++m) {
        float acc = 0.f;
        for (int64_t k = k0; k < k0 + gs; ++k) {
          const uint8_t b = w[r][k / kQ4Block * (kQ4Block / 2) + k % (kQ4Block / 2)];
          acc += x[m * in.ldx + k] * static_cast<float>(k % kQ4Block < kQ4Block / 2 ? b & 15 : b >> 4);
        }
        out[r][m] += s[r] * acc + c[r] * xs[m * in.ldxs + g];
      }
  }
#endif
}
#endif

// The tile and dot for L's group size (one of quant.py's INT4_GROUP_SIZES: make_linear checks).
#ifdef SLUICE_AVX512
template <typename C, int R, int MT>
inline __m512 q4_tile_g(const C* const w[R], const int64_t rows[R], bool run, const Linear& L, const Q4In& in,
                        const float* x, const float* xs, Prefetch& pf, bool t1) {
  switch (L.group) {
    case 32: return q4_tile<C, R, MT, 32>(w, rows, run, L, in, x, xs, pf, t1);
    case 64: return q4_tile<C, R, MT, 64>(w, rows, run, L, in, x, xs, pf, t1);
    case 128: return q4_tile<C, R, MT, 128>(w, rows, run, L, in, x, xs, pf, t1);
    default: return q4_tile<C, R, MT, 256>(w, rows, run, L, in, x, xs, pf, t1);
  }
}
#else
template <int N, int M>
inline void q4_dot_g(const uint8_t* const w[N], const int64_t rows[N], bool run, const Linear& L, const Q4In& in,
                     const float* x, const float* xs, float out[4][4], const char* pf = nullptr, bool far = false) {
  switch (L.group) {
    case 32: return q4_dot<N, M, 32>(w, rows, run, L, in, x, xs, out, pf, far);
    case 64: return q4_dot<N, M, 64>(w, rows, run, L, in, x, xs, out, pf, far);
    case 128: return q4_dot<N, M, 128>(w, rows, run, L, in, x, xs, out, pf, far);
    default: return q4_dot<N, M, 256>(w, rows, run, L, in, x, xs, out, pf, far);
  }
}
#endif

// block()'s int4 form: y[m, n - n0] (+)= x[m] . W[n] + b[n] for m < M, n0 <= n < n1, x given as a Q4In.
// The same tiles and passes as block() (see there), over groups of inputs instead of runs of 16.
inline void block_q4(const Linear& L, const Q4In& in, int64_t M, int64_t n0, int64_t n1, float* y, int64_t ldy,
                     bool accumulate, const void* after) {
  const uint8_t* w = static_cast<const uint8_t*>(L.w);
  [[maybe_unused]] const int64_t ldw = L.ldw, Kp = in.ldx, G = Kp / L.group;
  const float* bias = L.b;
  if (in.a) return block_q4i(L, in, M, n0, n1, y, ldy, accumulate, after);
#ifdef SLUICE_AVX512
  if (M == 1) {  // decode: tiles of 16 weight rows, the next 16 prefetched meanwhile, gs / 8 lines per group
    for (int64_t n = n0; n < n1; n += 16) {
      const uint8_t* wr[16];
      int64_t rows[16];
      for (int r = 0; r < 16; ++r) wr[r] = w + (rows[r] = std::min(n + r, n1 - 1)) * ldw;
      Prefetch pf;
      const void* next = n + 16 >= n1 && after ? after : L.row(n + 16);
      if (next) {
        pf.p = static_cast<const char*>(next);
        pf.end = pf.p + 16 * ldw;
        pf.per_step = (16 * ldw / 64 + G - 1) / G;
      }
      const __m512 s = q4_tile_g<uint8_t, 16, 1>(wr, rows, n + 16 <= n1, L, in, in.x, in.xs, pf, L.far);
      put16(s, nullptr, bias ? bias + n : nullptr, std::min<int64_t>(16, n1 - n), y + n - n0, accumulate);
    }
    return;
  }
  // Batches and prefill chunks: tiles of 4 weight rows x up to 4 activation rows in passes of weight rows that
  // stay in L1 while every activation row runs over them; from kWidenRows rows on, each pass's codes widened once
  // into an fp32 scratch (the unpacking, three operations per 16 codes, then paid once per pass, not per tile).
  constexpr int R = 4;
  const bool widen_pass = M >= kWidenRows;
  const int64_t pass_row_bytes = widen_pass ? Kp * static_cast<int64_t>(sizeof(float)) : ldw;
  const int64_t pass = M <= 8 ? R : std::clamp<int64_t>(kPassBytes / std::max<int64_t>(pass_row_bytes, 1) / R * R, R, 16);
  const int64_t lds = Kp + 16;  // a cache line longer than the row: rows 4 KB apart would share an L1 set
  static thread_local Scratch scratch_store;
  if (widen_pass && static_cast<int64_t>(scratch_store.size()) < pass * lds) scratch_store.resize(pass * lds);
  float* const scratch = scratch_store.data();
  for (int64_t p0 = n0; p0 < n1; p0 += pass) {
    const int64_t p1 = std::min(n1, p0 + pass);
    if (widen_pass)
      for (int64_t n = p0; n < p1; ++n) q4_widen_row(w + n * ldw, Kp, scratch + (n - p0) * lds);
    Prefetch pf;
    const void* next = p1 == n1 && after ? after : L.row(p1);
    if (next) {
      pf.p = static_cast<const char*>(next);
      pf.end = pf.p + (next == after ? pass : std::min(pass, L.n - p1)) * ldw;
      const int64_t steps = (M + 3) / 4 * ((p1 - p0 + R - 1) / R) * G, lines = (pf.end - pf.p + 63) / 64;
      pf.per_step = (lines + steps - 1) / steps;
    }
    const bool t1 = L.far || M > 4;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int64_t mm = std::min<int64_t>(4, M - m0);
      const float *xm = in.x + m0 * in.ldx, *xsm = in.xs + m0 * in.ldxs;
      for (int64_t n = p0; n < p1; n += R) {
        int64_t rows[R];
        for (int r = 0; r < R; ++r) rows[r] = std::min(n + r, n1 - 1);
        const bool run = n + R <= n1;
        __m512 s;
        if (widen_pass) {
          const float* wf[R];
          for (int r = 0; r < R; ++r) wf[r] = scratch + (rows[r] - p0) * lds;
          switch (mm) {
            case 1: s = q4_tile_g<float, R, 1>(wf, rows, run, L, in, xm, xsm, pf, t1); break;
            case 2: s = q4_tile_g<float, R, 2>(wf, rows, run, L, in, xm, xsm, pf, t1); break;
            case 3: s = q4_tile_g<float, R, 3>(wf, rows, run, L, in, xm, xsm, pf, t1); break;
            default: s = q4_tile_g<float, R, 4>(wf, rows, run, L, in, xm, xsm, pf, t1);
          }
        } else {
          const uint8_t* wr[R];
          for (int r = 0; r < R; ++r) wr[r] = w + rows[r] * ldw;
          switch (mm) {
            case 1: s = q4_tile_g<uint8_t, R, 1>(wr, rows, run, L, in, xm, xsm, pf, t1); break;
            case 2: s = q4_tile_g<uint8_t, R, 2>(wr, rows, run, L, in, xm, xsm, pf, t1); break;
            case 3: s = q4_tile_g<uint8_t, R, 3>(wr, rows, run, L, in, xm, xsm, pf, t1); break;
            default: s = q4_tile_g<uint8_t, R, 4>(wr, rows, run, L, in, xm, xsm, pf, t1);
          }
        }
        put4(s, nullptr, bias ? bias + n : nullptr, std::min<int64_t>(R, n1 - n), y + m0 * ldy + n - n0, ldy, mm,
             accumulate);
      }
    }
  }
#else
  auto put = [&](int64_t m, int64_t n, float s) {
    s += bias ? bias[n] : 0.f;
    float& dst = y[m * ldy + n - n0];
    dst = accumulate ? dst + s : s;
  };
  float o[4][4];
  const uint8_t* wr[4];
  int64_t rows[4];
  if (M == 1) {  // decode: 4 weight rows at a time, the next 4 prefetched (one line per block of 32 inputs)
    for (int64_t n = n0; n < n1; n += 4) {
      for (int r = 0; r < 4; ++r) wr[r] = w + (rows[r] = std::min(n + r, n1 - 1)) * ldw;
      const char* next = n + 8 <= L.n ? static_cast<const char*>(L.row(n + 4)) : nullptr;
      q4_dot_g<4, 1>(wr, rows, n + 4 <= n1, L, in, in.x, in.xs, o, next, L.far);
      for (int64_t r = 0; r < std::min<int64_t>(4, n1 - n); ++r) put(0, n + r, o[r][0]);
    }
    return;
  }
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const int64_t mm = std::min<int64_t>(4, M - m0);
    const float *xm = in.x + m0 * in.ldx, *xsm = in.xs + m0 * in.ldxs;
    for (int64_t n = n0; n < n1; n += 2) {
      for (int r = 0; r < 2; ++r) wr[r] = w + (rows[r] = std::min(n + r, n1 - 1)) * ldw;  // an odd last row pairs with itself
      switch (mm) {
        case 1: q4_dot_g<2, 1>(wr, rows, false, L, in, xm, xsm, o); break;
        case 2: q4_dot_g<2, 2>(wr, rows, false, L, in, xm, xsm, o); break;
        case 3: q4_dot_g<2, 3>(wr, rows, false, L, in, xm, xsm, o); break;
        default: q4_dot_g<2, 4>(wr, rows, false, L, in, xm, xsm, o);
      }
      for (int64_t m = 0; m < mm; ++m) {
        put(m0 + m, n, o[0][m]);
        if (n + 1 < n1) put(m0 + m, n + 1, o[1][m]);
      }
    }
  }
#endif
}
