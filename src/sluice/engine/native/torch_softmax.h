// torch's CPU softmax of an fp32 row, bit for bit, in pieces (sample.cpp's top_p uses them to reproduce the
// probabilities filtering.py compares with top_p, so its decision is torch's without a full sort).
//
// ATen's softmax over the last dim (SoftMaxKernel.cpp, _vec_softmax_lastdim) computes, per row:
//   e_i = exp(x_i - max) with Vectorized<float>::exp, which is Sleef's expf (u10) with FMA;
//   S   = vec::reduce_all(+) of e: W lanes (W = 16 under torch's AVX512 capability, 8 under AVX2), lane l
//         the sequential float sum of e at positions l, l + W, ...; then the lanes folded as halves, quarters
//         ... (vec_reduce_all's shuffles); a row shorter than W is summed left to right;
//   p_i = e_i * (1 / S), in float.
// Checked against torch.softmax for both capabilities (tests/engine/test_sample_native.py). Each step is one
// IEEE operation (fmaf is a single rounding, as the vector FMA is), so scalar code gives the vector bits.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace sluice_softmax {

inline float pow2i(int32_t q) {  // 2^q from its exponent bits (q in the normal range)
  const uint32_t bits = static_cast<uint32_t>(q + 0x7f) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Sleef's xexpf (sleefsimdsp.c) for d <= 0, as torch's vectorised exp computes it. Without branches, so a loop
// of it vectorises; d below -104 gives 0 (Sleef's cut), and is clamped first so the integer part stays small.
inline float expf_u10(float d) {
  const float c = std::fmax(d, -110.0f);
  const int32_t q = static_cast<int32_t>(std::rint(c * 1.442695040888963407359924681001892137426645954152985934135449406931f));
  const float qf = static_cast<float>(q);
  float s = std::fma(qf, -0.693145751953125f, c);
  s = std::fma(qf, -1.428606765330187045e-06f, s);
  float u = 0.000198527617612853646278381f;
  u = std::fma(u, s, 0.00139304355252534151077271f);
  u = std::fma(u, s, 0.00833336077630519866943359f);
  u = std::fma(u, s, 0.0416664853692054748535156f);
  u = std::fma(u, s, 0.166666671633720397949219f);
  u = std::fma(u, s, 0.5f);
  u = 1.0f + std::fma(s * s, u, s);
  u = u * pow2i(q >> 1) * pow2i(q - (q >> 1));
  return d < -104.0f ? 0.0f : u;
}

// The same, 16 or 8 lanes at a time (the compiler does not vectorise the scalar one): the same operations in
// the same order, lane by lane, so the same bits.
#ifdef __AVX512F__
inline __m512 expf_u10(__m512 d) {
  const __m512 c = _mm512_max_ps(d, _mm512_set1_ps(-110.0f));
  const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(c, _mm512_set1_ps(1.442695040888963407359924681001892137426645954152985934135449406931f)));
  const __m512 qf = _mm512_cvtepi32_ps(q);
  __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-0.693145751953125f), c);
  s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-1.428606765330187045e-06f), s);
  __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
  u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
  u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
  const __m512i h = _mm512_srai_epi32(q, 1), bias = _mm512_set1_epi32(0x7f);
  u = _mm512_mul_ps(u, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(h, bias), 23)));
  u = _mm512_mul_ps(u, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_sub_epi32(q, h), bias), 23)));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.0f), _CMP_LT_OQ), u, _mm512_setzero_ps());
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 expf_u10(__m256 d) {
  const __m256 c = _mm256_max_ps(d, _mm256_set1_ps(-110.0f));
  const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(c, _mm256_set1_ps(1.442695040888963407359924681001892137426645954152985934135449406931f)));
  const __m256 qf = _mm256_cvtepi32_ps(q);
  __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-0.693145751953125f), c);
  s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-1.428606765330187045e-06f), s);
  __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
  u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
  u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
  const __m256i h = _mm256_srai_epi32(q, 1), bias = _mm256_set1_epi32(0x7f);
  u = _mm256_mul_ps(u, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, bias), 23)));
  u = _mm256_mul_ps(u, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(q, h), bias), 23)));
  return _mm256_blendv_ps(u, _mm256_setzero_ps(), _mm256_cmp_ps(d, _mm256_set1_ps(-104.0f), _CMP_LT_OQ));
}
#endif

// The lanes' fold after the main loop (vec_reduce_all): lane l += lane l ^ half, for half = W/2, ..., 1.
inline float fold_lanes(float* acc, int W) {
  for (int half = W / 2; half >= 1; half /= 2) {
    float next[16];
    for (int l = 0; l < W; ++l) next[l] = acc[l] + acc[l ^ half];
    std::memcpy(acc, next, W * sizeof(float));
  }
  return acc[0];
}

}  // namespace sluice_softmax
