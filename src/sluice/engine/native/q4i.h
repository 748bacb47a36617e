// q4.h's integer-dot mode for int4 products (Linear::idot: every product of the step, decode and prefill, so that a
// token's numbers never depend on how many rows shared its call), the arithmetic of llama.cpp's Q4_0 x Q8_0 dot
// written for quant.py's layout. Included by q4.h after q4_scales.
//
// Why: widening the codes to fp32 costs ~9 cycles per 32 weights per row, so int4 decode was compute-bound at a
// third of the read bandwidth. Here each activation row is quantized per block of 32 inputs to int8 (d = max|x|
// / 127, a = rint(x / d), as Q8_0), and per weight row and block the integer sum(q a) of the u8 codes q and the
// s8 a is exact in int32 (q4t.h's tiles of interleaved rows in the SIMD builds, plain loops otherwise).
// Per group: y += s * sum_b d_b isum_b + (z - 8 s) * sum_b d_b asum_b; the second sum is the row's, made once
// here (dsum). The price is the rounding of x to 8 bits: about 2^-8 of each block's largest |x| per input (see
// tests/engine/test_fast_step_int4.py for the bound checked against the dequantized model).
//
// A token's numbers do not depend on its batch: its quantization is its row's alone, and every (weight row,
// token row) pair runs the same operations in the same order in every tile. The integer sums are exact and the
// fp32 part is one lane's (or one scalar's) fixed sequence, so every build gives the same bits.

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

#include "q4t.h"

// block_q4's integer-dot form (in.a set): y[m, n - n0] (+)= x[m] . W[n] + b[n]. The SIMD builds take q4t.h's tiles
// (Step packs every int4 linear when the integer dot is on); without SIMD, per (weight row, token row) the
// arithmetic of a tile's lane in scalars.
inline void block_q4i(const Linear& L, const Q4In& in, int64_t M, int64_t n0, int64_t n1, float* y, int64_t ldy,
                      bool accumulate, const void* after) {
#ifdef SLUICE_AVX2
  block_q4t(L, in, M, n0, n1, y, ldy, accumulate, after);
#else
  (void)after;
  const uint8_t* w = static_cast<const uint8_t*>(L.w);
  const int64_t Kp = 2 * L.ldw, per = L.group / kQ4Block, G = Kp / L.group;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      const uint8_t* wn = w + n * L.ldw;
      const int8_t* a = in.a + m * Kp;
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        float s, c;
        q4_scales<1>(L, g, &n, false, &s, &c);
        float gacc = 0.f;
        for (int64_t b = 0; b < per; ++b) {
          const int64_t k = (g * per + b) * kQ4Block;
          int isum = 0;
          for (int64_t j = 0; j < kQ4Block / 2; ++j)
            isum += (wn[k / 2 + j] & 15) * a[k + j] + (wn[k / 2 + j] >> 4) * a[k + j + kQ4Block / 2];
          const float f = static_cast<float>(isum), d = in.d[m * in.nb + k / kQ4Block];
          gacc = b == 0 ? f * d : std::fma(f, d, gacc);
        }
        acc = std::fma(s, gacc, acc);
        acc = std::fma(c, in.dsum[m * in.ng + g], acc);
      }
      const float e = acc + (L.b ? L.b[n] : 0.f);
      float& dst = y[m * ldy + n - n0];
      dst = accumulate ? dst + e : e;
    }
#endif
}
