// q4.h's integer-dot mode for int4 products (Linear::idot: every product of the step, decode and prefill, so that a
// token's numbers never depend on how many rows shared its call), the arithmetic of llama.cpp's Q4_0 x Q8_0 dot
// written for quant.py's layout. Included by q4.h after q4_scales.
//
// Why: widening the codes to fp32 costs ~9 cycles per 32 weights per row, so int4 decode was compute-bound at a
// third of the read bandwidth. Here each activation row is quantized per block of 32 inputs to int8 (d = max|x|
// / 127, a = rint(x / d), as Q8_0), and per weight row and block the integer sum(q a) of the u8 codes q and the
// s8 a takes one instruction (VNNI dpbusd) or two (AVX2 maddubs + madd; 15 * 127 * 2 cannot saturate int16).
// Per group: y += s * sum_b d_b isum_b + (z - 8 s) * sum_b d_b asum_b; the second sum is the row's, made once
// here (dsum). The price is the rounding of x to 8 bits: about 2^-8 of each block's largest |x| per input (see
// tests/engine/test_fast_step_int4.py for the bound checked against the dequantized model).
//
// A token's numbers do not depend on its batch: its quantization is its row's alone, and every (weight row,
// token row) pair runs the same operations in the same order in every tile. The integer sums are exact, and
// the fp32 part uses 8-lane vectors in every SIMD build, so the AVX-512 and AVX2 builds give the same bits.

// One block of 32 inputs to int8: ab = rint(clamp(x * 127 / max|x|)), d = max|x| / 127; returns sum(ab). The
// vector form gives the scalar one's bits: max is exact in any order, the product and the clamp are the same
// operations, and the conversion rounds to nearest even as nearbyint does under the default rounding mode.
inline int q4i_round(const float* xb, int8_t* ab, float& d) {
#ifdef SLUICE_AVX2
  __m256 x[4], mx = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int i = 0; i < 4; ++i) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, x[i] = _mm256_loadu_ps(xb + 8 * i)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  d = amax / 127.f;
  const __m256 id = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  __m256i v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(x[i], id), lo), hi));
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(ab), _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
#else
  float amax = 0.f;
  for (int j = 0; j < kQ4Block; ++j) amax = std::max(amax, std::fabs(xb[j]));
  d = amax / 127.f;
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  int asum = 0;
  for (int j = 0; j < kQ4Block; ++j) {
    const int v = static_cast<int>(std::nearbyint(std::clamp(xb[j] * id, -127.f, 127.f)));
    ab[j] = static_cast<int8_t>(v);
    asum += v;
  }
  return asum;
#endif
}

// Quantize M rows of x (ldx apart, Kp inputs each, zero-padded) into this thread's buffers and point in at them.
inline void q4i_quantize(int64_t group, const float* x, int64_t ldx, int64_t M, int64_t Kp, Q4In& in) {
  static thread_local std::vector<int8_t> codes;
  static thread_local Scratch scales;
  const int64_t B = Kp / kQ4Block, G = Kp / group, per = group / kQ4Block;
  if (static_cast<int64_t>(codes.size()) < M * Kp) codes.resize(M * Kp);
  if (static_cast<int64_t>(scales.size()) < M * (B + G)) scales.resize(M * (B + G));
  in.a = codes.data();
  in.d = scales.data();
  in.dsum = scales.data() + M * B;
  in.nb = B;
  in.ng = G;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < B; ++b) {
      const float* xb = x + m * ldx + b * kQ4Block;
      int8_t* ab = codes.data() + m * Kp + b * kQ4Block;
      float d;
      const int asum = q4i_round(xb, ab, d);
      in.d[m * B + b] = d;
      float& ds = in.dsum[m * G + b / per];
      ds = b % per == 0 ? d * static_cast<float>(asum) : std::fma(d, static_cast<float>(asum), ds);
    }
}

#ifdef SLUICE_AVX2
// The 32 codes of the block at byte p as u8, inputs in order: the low nibbles (inputs 0..15), then the high ones.
// The 16 bytes load into both halves (a load-port broadcast), the upper half's 32-bit lanes shift right by 4 and
// the mask keeps each byte's own nibble: three instructions, none on the shuffle port.
inline __m256i q4i_codes(const uint8_t* p) {
  const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(15));
}

// Eight int32 lanes summing to sum(q a) over the block (q u8 in [0, 15], a s8), exact on every path.
inline __m256i q4i_dot(__m256i q, __m256i a) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, a);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), q, a);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), _mm256_set1_epi16(1));
#endif
}
#endif

#include "q4t.h"

// out[r][m] = weight row w[r] . token row m0 + m (before bias), for R weight rows and MT token rows.
template <int R, int MT, int GS>
inline void q4i_tile(const uint8_t* const w[R], const int64_t rows[R], bool run, const Linear& L, const Q4In& in,
                     int64_t m0, float out[R][MT], const char* pf, int64_t pf_step, bool far) {
  constexpr int64_t per = GS / kQ4Block;
  const int64_t Kp = 2 * L.ldw;
  alignas(64) float s[R < 16 ? 16 : R], c[R < 16 ? 16 : R];
  float cacc[R][MT] = {};
#ifdef SLUICE_AVX2
  __m256 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
#else
  float acc[R][MT] = {};
#endif
  (void)pf, (void)pf_step, (void)far;
  for (int64_t k0 = 0, g = 0; k0 < Kp; k0 += GS, ++g) {
#ifdef SLUICE_AVX2
    if (pf)
      for (int64_t j = 0; j < pf_step; ++j, pf += 64) {
        if (far) _mm_prefetch(pf, _MM_HINT_T1);
        else _mm_prefetch(pf, _MM_HINT_T0);
      }
#endif
    q4_scales<R>(L, g, rows, run, s, c);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
#ifdef SLUICE_AVX2
      __m256 gacc[MT];
#pragma GCC unroll 8
      for (int64_t b = 0; b < per; ++b) {
        const int64_t k = k0 + b * kQ4Block;
        const __m256i q = q4i_codes(w[r] + k / 2);
        for (int m = 0; m < MT; ++m) {
          const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.a + (m0 + m) * Kp + k));
          const __m256 f = _mm256_cvtepi32_ps(q4i_dot(q, a));
          const __m256 d = _mm256_set1_ps(in.d[(m0 + m) * in.nb + k / kQ4Block]);
          gacc[m] = b == 0 ? _mm256_mul_ps(f, d) : _mm256_fmadd_ps(f, d, gacc[m]);
        }
      }
      const __m256 sv = _mm256_set1_ps(s[r]);
      for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_fmadd_ps(sv, gacc[m], acc[r][m]);
#else
      for (int m = 0; m < MT; ++m) {
        float gacc = 0.f;
        for (int64_t b = 0; b < per; ++b) {
          const int64_t k = k0 + b * kQ4Block;
          const int8_t* a = in.a + (m0 + m) * Kp + k;
          int isum = 0;
          for (int j = 0; j < kQ4Block / 2; ++j)
            isum += (w[r][k / 2 + j] & 15) * a[j] + (w[r][k / 2 + j] >> 4) * a[j + kQ4Block / 2];
          gacc = std::fma(static_cast<float>(isum), in.d[(m0 + m) * in.nb + k / kQ4Block], gacc);
        }
        acc[r][m] = std::fma(s[r], gacc, acc[r][m]);
      }
#endif
      for (int m = 0; m < MT; ++m) cacc[r][m] = std::fma(c[r], in.dsum[(m0 + m) * in.ng + g], cacc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) {
#ifdef SLUICE_AVX2
      out[r][m] = sluice_simd::hsum(acc[r][m]) + cacc[r][m];
#else
      out[r][m] = acc[r][m] + cacc[r][m];
#endif
    }
}

template <int R, int MT>
inline void q4i_tile_g(const uint8_t* const w[R], const int64_t rows[R], bool run, const Linear& L, const Q4In& in,
                       int64_t m0, float out[R][MT], const char* pf, int64_t pf_step, bool far) {
  switch (L.group) {
    case 32: return q4i_tile<R, MT, 32>(w, rows, run, L, in, m0, out, pf, pf_step, far);
    case 64: return q4i_tile<R, MT, 64>(w, rows, run, L, in, m0, out, pf, pf_step, far);
    case 128: return q4i_tile<R, MT, 128>(w, rows, run, L, in, m0, out, pf, pf_step, far);
    default: return q4i_tile<R, MT, 256>(w, rows, run, L, in, m0, out, pf, pf_step, far);
  }
}

// block_q4's integer-dot form (in.a set): tiles of 4 weight rows x up to kQ4iRows token rows, every group of token
// rows over a tile before the next tile, so its rows stay in L1 (a prefill chunk's weights are read once); the
// first group prefetches the next tile's rows a few lines per group of inputs.
#ifdef SLUICE_AVX512
constexpr int64_t kQ4iRows = 4;  // 16 accumulators of 32 registers
#else
constexpr int64_t kQ4iRows = 2;  // 8 of 16
#endif
inline void block_q4i(const Linear& L, const Q4In& in, int64_t M, int64_t n0, int64_t n1, float* y, int64_t ldy,
                      bool accumulate, const void* after) {
#ifdef SLUICE_AVX2
  if (L.wt) return block_q4t(L, in, M, n0, n1, y, ldy, accumulate, after);
#endif
  constexpr int R = 4;
  const uint8_t* w = static_cast<const uint8_t*>(L.w);
  const int64_t ldw = L.ldw, G = 2 * ldw / L.group;
  const float* bias = L.b;
  auto put = [&](int64_t m, int64_t n, float v) {
    v += bias ? bias[n] : 0.f;
    float& dst = y[m * ldy + n - n0];
    dst = accumulate ? dst + v : v;
  };
  for (int64_t n = n0; n < n1; n += R) {
    const uint8_t* wr[R];
    int64_t rows[R];
    for (int r = 0; r < R; ++r) wr[r] = w + (rows[r] = std::min(n + r, n1 - 1)) * ldw;
    const void* next = n + R >= n1 && after ? after : L.row(n + R);
    const int64_t pf_step = (R * ldw / 64 + G - 1) / G;
    const bool run = n + R <= n1;
    for (int64_t m0 = 0; m0 < M; m0 += kQ4iRows) {
      const int64_t mm = std::min(kQ4iRows, M - m0);
      const char* pf = m0 == 0 ? static_cast<const char*>(next) : nullptr;
      float o[R][kQ4iRows];
      auto tile = [&](auto rows_c) {
        constexpr int MT = decltype(rows_c)::value;
        float t[R][MT];
        q4i_tile_g<R, MT>(wr, rows, run, L, in, m0, t, pf, pf_step, L.far);
        for (int r = 0; r < R; ++r)
          for (int m = 0; m < MT; ++m) o[r][m] = t[r][m];
      };
      switch (mm) {
        case 1: tile(std::integral_constant<int, 1>{}); break;
#ifdef SLUICE_AVX512
        case 2: tile(std::integral_constant<int, 2>{}); break;
        case 3: tile(std::integral_constant<int, 3>{}); break;
        default: tile(std::integral_constant<int, 4>{});
#else
        default: tile(std::integral_constant<int, 2>{});
#endif
      }
      for (int64_t r = 0; r < std::min<int64_t>(R, n1 - n); ++r)
        for (int64_t m = 0; m < mm; ++m) put(m0 + m, n + r, o[r][m]);
    }
  }
}
