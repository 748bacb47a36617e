// The race that draws a token from a distribution (speculative.draw's definition, as the torch rule computes
// it), and a draft's guess for one row: shared by accept.cpp (the acceptance rule and the draft's guess a call at
// a time) and step.cpp (a draft's whole round of guesses in one call, Step.guess). One definition, so both
// calls draw the same tokens.
//
// The race over d: log(d) - log(-log u), u from the row's counter noise (noise.py). Its logs are computed in
// double with a bound on how far torch's float keys can be, and a winner is taken only where the bound proves
// torch picks it (as sample.cpp does); else the caller defers to the torch rule.
#pragma once

#include <limits>

// (after spec_rows.h, which turns float contraction off for everything that follows it: the race's bounds and
// the filters are the float operations torch does, not fused ones)
#include "spec_rows.h"
#include "row_max.h"

namespace sluice_draw {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr double kLogErr = 0x1p-21;  // torch's float log (Sleef, 1 ulp claimed): 4 ulp allowed
constexpr double kUlp = 0x1p-23;

inline uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// noise.py: a row's base at draw s in a domain, and the 24 random bits of token t under it.
inline uint64_t base_of(uint64_t key, uint64_t domain, int64_t draw) {
  return mix((key ^ domain) + (static_cast<uint64_t>(draw) + 1) * kGolden);
}
inline uint32_t bits_of(uint64_t base, int64_t t) {
  return static_cast<uint32_t>(mix(base + (static_cast<uint64_t>(t) + 1) * kGolden) >> 40);
}

// -log(-log max(u, FLT_MIN)) for u = bits 2^-24 (speculative.draw's noise term, negated), in double.
inline double minus_log_e(uint32_t bits) {
  const double u = std::max(bits * 0x1p-24, static_cast<double>(std::numeric_limits<float>::min()));
  return -std::log(-std::log(u));
}

using sluice_rows::first_max;  // the first index of a row's largest value (row_max.h: vector scans)

struct Rival {
  double key, tol;
  int64_t id;
};

// The race's winner over d (NaN-free, some d_i > 0) with noise base `base`, or -1 when torch's float keys
// could rank two contenders either way. A token with d_i = 0 has key -inf and never wins. The noise term
// -log(-log u) is at most -log(1 - u), so a token's key is at most log(d_i / (1 - u_i)): one that cannot
// reach the leader's key by that bound is passed over on a product and a compare, without a log (an
// unfiltered draft row races all 8,192 tokens: two logs each cost ~0.2 ms a draw).
inline int64_t race(const float* d, int64_t V, uint64_t base, std::vector<Rival>& rivals) {
  const int64_t lead = first_max(d, V);
  auto rival = [&](int64_t i, uint32_t bits) {
    const double ld = std::log(static_cast<double>(d[i])), le = minus_log_e(bits), key = ld + le;
    return Rival{key, kLogErr * (1 + std::fabs(ld) + std::fabs(le)) + 2 * kUlp * std::fabs(key) + 1e-30, i};
  };
  rivals.assign(1, rival(lead, bits_of(base, lead)));
  const double reach = rivals[0].key - rivals[0].tol - 1e-3;
  const double need = std::exp(reach) * (1 - 1e-6) * 0x1p-24;  // d_i (2^24 - bits) 2^-24 below e^reach: out
  auto consider = [&](int64_t i) {
    if (i == lead || !(d[i] > 0)) return;
    const uint32_t bits = bits_of(base, i);
    if (static_cast<double>(d[i]) < need * static_cast<double>((1u << 24) - bits)) return;
    const Rival r = rival(i, bits);
    if (r.key + r.tol >= reach) rivals.push_back(r);
  };
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  // The same test 8 tokens at a time (the noise bits by 64-bit lane multiplies): only the tokens it cannot
  // pass over go on to the scalar test above, which takes the same decision again, so the same rivals.
  const __m512i golden = _mm512_set1_epi64(static_cast<long long>(kGolden)), step = _mm512_set1_epi64(static_cast<long long>(8 * kGolden));
  const __m512i m1 = _mm512_set1_epi64(static_cast<long long>(0xBF58476D1CE4E5B9ull));
  const __m512i m2 = _mm512_set1_epi64(static_cast<long long>(0x94D049BB133111EBull));
  const __m512d needv = _mm512_set1_pd(need), top = _mm512_set1_pd(0x1p24), zero = _mm512_setzero_pd();
  __m512i z0 = _mm512_add_epi64(_mm512_set1_epi64(static_cast<long long>(base)),
                                _mm512_mullo_epi64(_mm512_setr_epi64(1, 2, 3, 4, 5, 6, 7, 8), golden));
  for (; i + 8 <= V; i += 8, z0 = _mm512_add_epi64(z0, step)) {
    __m512i z = _mm512_xor_si512(z0, _mm512_srli_epi64(z0, 30));
    z = _mm512_mullo_epi64(z, m1);
    z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 27));
    z = _mm512_mullo_epi64(z, m2);
    z = _mm512_srli_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 31)), 40);
    const __m512d dv = _mm512_cvtps_pd(_mm256_loadu_ps(d + i));
    const __m512d bound = _mm512_mul_pd(needv, _mm512_sub_pd(top, _mm512_cvtepi64_pd(z)));
    // kept for the scalar test: d > 0 and not d < bound (a NaN d is neither: passed over, as there)
    const __mmask8 go = _mm512_cmp_pd_mask(dv, zero, _CMP_GT_OQ) & ~_mm512_cmp_pd_mask(dv, bound, _CMP_LT_OQ);
    for (unsigned m = go; m; m &= m - 1) consider(i + __builtin_ctz(m));
  }
#endif
  for (; i < V; ++i) consider(i);
  Rival best = rivals[0];
  for (const Rival& r : rivals)
    if (r.key > best.key || (r.key == best.key && r.id < best.id)) best = r;
  for (const Rival& r : rivals)
    if (r.id != best.id && r.key + r.tol >= best.key - best.tol) return -1;
  return best.id;
}

using sluice_rows::has_nan;  // whether a row holds a NaN (row_max.h)

// A draft's guess for one row (accept.cpp's propose, a row of it): d (V,), zeroed by the caller, gets the
// row's q (RoundProbs' nucleus_row of the logits x with temperature T and top_p off; a one-hot first argmax
// where T is 0), and the token is the race over d under the row's stream (key, draw) where `sampled`, else d's
// first argmax. -1: deferred (a non-finite logit, a NaN in d, or a race the bound cannot settle), d then unset.
inline int64_t propose_row(const float* x, int64_t V, float T, bool sampled, uint64_t key, int64_t draw, int W,
                           float* d, sluice_spec::Nucleus& scratch, std::vector<Rival>& rivals) {
  if (T > 0) {
    if (!sluice_spec::nucleus_row(x, V, T, 1.f, W, d, scratch) || has_nan(d, V)) return -1;
  } else {
    const int64_t top = sluice_rows::finite_first_max(x, V);  // -1 on a non-finite logit (a sampled row's too)
    if (top < 0) return -1;
    d[top] = 1.f;
    if (!sampled) return top;  // d's first argmax: its one 1 in zeros
  }
  return sampled ? race(d, V, base_of(key, 0, draw), rivals) : first_max(d, V);
}

}  // namespace sluice_draw
