// A row's first maximum, 16 or 8 floats at a time: shared by select.cpp (the sampler's argmax), sample.cpp (its
// scans), spec_rows.h (a filtered row's max) and draw.h (a greedy guess and a greedy verify position in the
// speculative calls, and their NaN checks). Nothing here does arithmetic on the
// values: the results are an index and a flag, exactly what the scalar walk `if (p[i] > p[best]) best = i` gives
// on a NaN-free row (tests compare with torch.argmax).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "simd.h"

namespace sluice_rows {

inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The row's largest value and whether it holds a NaN or an inf (v - v is NaN exactly then).
inline void max_and_finite(const float* p, int64_t V, float& best, bool& finite) {
  int64_t j = 0;
  best = kNegInf;
  finite = true;
#ifdef __AVX512F__
  __m512 m = _mm512_set1_ps(kNegInf);
  __mmask16 bad = 0;
  for (; j + 16 <= V; j += 16) {
    const __m512 v = _mm512_loadu_ps(p + j);
    const __m512 d = _mm512_sub_ps(v, v);
    bad |= _mm512_cmp_ps_mask(d, d, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, v);  // NaN lanes are caught by `bad`; the max is then unused
  }
  best = _mm512_reduce_max_ps(m);
  finite = bad == 0;
#elif defined(SLUICE_AVX2)
  __m256 m = _mm256_set1_ps(kNegInf);
  int bad = 0;
  for (; j + 8 <= V; j += 8) {
    const __m256 v = _mm256_loadu_ps(p + j);
    const __m256 d = _mm256_sub_ps(v, v);
    bad |= _mm256_movemask_ps(_mm256_cmp_ps(d, d, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (float l : lanes) best = std::max(best, l);
  finite = bad == 0;
#endif
  for (; j < V; ++j) {
    finite = finite && std::isfinite(p[j]);
    best = std::max(best, p[j]);
  }
}

// The first j with p[j] == best (a finite row holds its max): 16 or 8 at a time, since a scalar walk to a
// max in the middle of a row cost more than the scan that found it.
inline int64_t first_index_of(const float* p, int64_t V, float best) {
  int64_t j = 0;
#ifdef __AVX512F__
  for (const __m512 bv = _mm512_set1_ps(best); j + 16 <= V; j += 16)
    if (const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(p + j), bv, _CMP_EQ_OQ)) return j + __builtin_ctz(hit);
#elif defined(SLUICE_AVX2)
  for (const __m256 bv = _mm256_set1_ps(best); j + 8 <= V; j += 8)
    if (const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + j), bv, _CMP_EQ_OQ))) return j + __builtin_ctz(hit);
#endif
  while (p[j] != best) ++j;
  return j;
}

// The first index of p's maximum, as the scalar walk gives it for any row: on a finite row the vector scans above,
// else (a NaN or an inf) the walk itself, whose NaN comparisons are false.
inline int64_t first_max(const float* p, int64_t V) {
  float best;
  bool finite;
  max_and_finite(p, V, best, finite);
  if (finite) return first_index_of(p, V, best);
  int64_t at = 0;
  for (int64_t i = 1; i < V; ++i)
    if (p[i] > p[at]) at = i;
  return at;
}

// The first index of p's maximum, or -1 where the row holds a NaN or an inf (one scan decides both).
inline int64_t finite_first_max(const float* p, int64_t V) {
  float best;
  bool finite;
  max_and_finite(p, V, best, finite);
  return finite ? first_index_of(p, V, best) : -1;
}

// Whether p holds a NaN (an inf is not one), 16 or 8 at a time.
inline bool has_nan(const float* p, int64_t V) {
  int64_t j = 0;
#ifdef __AVX512F__
  __mmask16 bad = 0;
  for (; j + 16 <= V; j += 16) {
    const __m512 v = _mm512_loadu_ps(p + j);
    bad |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  if (bad) return true;
#elif defined(SLUICE_AVX2)
  int bad = 0;
  for (; j + 8 <= V; j += 8) {
    const __m256 v = _mm256_loadu_ps(p + j);
    bad |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  if (bad) return true;
#endif
  for (; j < V; ++j)
    if (std::isnan(p[j])) return true;
  return false;
}

}  // namespace sluice_rows
