// The SIMD helpers sluice's CPU kernels share (step.cpp, gemv.cpp, select.cpp).
//
// Every kernel is built with -march=native (engine/native/build.py), so the paths are chosen at compile
// time from what this CPU has: SLUICE_AVX2 with AVX2 + FMA, SLUICE_AVX512 when AVX-512F comes on top,
// plain loops otherwise. One definition of each helper keeps the kernels' arithmetic identical where
// they share it (a bf16 weight widens the same way in the decode linear and in the whole step).
#pragma once

#include <torch/extension.h>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SLUICE_AVX2 1
#endif
#if defined(SLUICE_AVX2) && defined(__AVX512F__)
#define SLUICE_AVX512 1  // -march=native on a CPU with AVX-512: step.cpp's products use 16-lane tiles
#endif

namespace sluice_simd {

#ifdef SLUICE_AVX2
// Widen 8 stored values to fp32 lanes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {  // bf16 is the high half of an fp32: widen by a 16-bit shift
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const int8_t* p) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

// The sum of the 8 lanes, in one fixed order (halves, then pairs, then the last two).
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// One stored value to fp32: the scalar tails of the loops above.
inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) { return static_cast<float>(v); }
inline float widen(int8_t v) { return static_cast<float>(v); }

// dot(a[0:K], b[0:K]) with four accumulators, so a lone dot product is not one chain of dependent FMAs
// (step.cpp's attention scores: a query row against each cached key, on AVX2).
inline float dot(const float* a, const float* b, int64_t K) {
  int64_t k = 0;
  float out = 0.f;
#ifdef SLUICE_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; k + 32 <= K; k += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 16), _mm256_loadu_ps(b + k + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 24), _mm256_loadu_ps(b + k + 24), a3);
  }
  for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), a0);
  out = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
  for (; k < K; ++k) out += a[k] * b[k];
  return out;
}

}  // namespace sluice_simd

// What build.py checks after loading a kernel: a build that lost -march=native (and with it AVX2 + FMA)
// would run the plain loops, correct but several times slower, so it is refused rather than used.
inline bool has_avx2() {
#ifdef SLUICE_AVX2
  return true;
#else
  return false;
#endif
}

inline bool has_avx512() {
#ifdef SLUICE_AVX512
  return true;
#else
  return false;
#endif
}
