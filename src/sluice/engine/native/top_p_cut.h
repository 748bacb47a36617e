// torch's top_p cut of a row (filtering._candidates with top_k off) without sorting the row: sample.cpp
// tries this first and sorts (its exact head sort) only where this cannot prove the answer.
//
// Why it can skip the sort: torch keeps the sorted prefix whose fp32 cumulative mass before each token is
// < top_p, and that mass depends on the order of the row only near the cut. Two things are pinned down:
// - torch's softmax sum S (a float sum in W lanes over the sorted row) is bracketed without the sort: each
//   of its roundings is at most 2^-24 of the lane's sum and at most the value added (bounded_cut says how
//   these add up); the fold of the lanes adds log2(W) roundings of at most 2^-24 S each. So
//   1 / S, a float, lies between two floats inv_lo and inv_hi. Each probability fl(e * inv) grows with
//   inv, and so does every cumulative mass: the cut moves only one way as inv does. Where inv_lo and
//   inv_hi give the same cut, every inv between them does too, torch's among them.
// - the cumulative masses: the pass that bounds S also keeps the tokens whose mass can reach the cut (all
//   the others together hold under a quarter of 1 - top_p), a few hundred of a row of 8,192 like a model's;
//   a few passes of 8 thresholds each over those find a bracket [lo, hi) of them holding the cut; the mass of every token >= hi is a float64 sum (in another order
//   than torch's sequential one: the two differ by at most 2 n 2^-53 of the mass), and only the bracket is
//   sorted (stably: equal values keep ids ascending, as torch's stable sort), its masses added one by one
//   as torch does. A comparison with top_p that the 2 n 2^-53 could flip is not taken.
// Anything not proven (a cut that moves between inv_lo and inv_hi, a mass too near top_p, a min_p
// probability within 2^-22 of its floor) returns false, and sample.cpp sorts as before. A cut that moves
// between the two ends, each end's proven, can still serve a draw (moving_ok): torch's kept prefix is one of
// those between, and a race won by a token all of them keep has the same winner in each.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "radix.h"
#include "torch_softmax.h"

namespace sluice_top_p {

// How many rows were cut here, how many with a cut that moved within the bracket (moving_ok: sample.cpp's draws,
// which then need only the winner to be a token every such cut keeps), and how many went on to the sort (tests
// check each happens). bounded_cut counts the first two as it returns true; its callers count their sorts.
inline std::atomic<int64_t> bounded{0}, moving{0}, sorted{0};

#ifdef __AVX512F__
constexpr int kL = 16;
using Vf = __m512;
inline Vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vf vset(float x) { return _mm512_set1_ps(x); }
inline uint32_t vge(Vf a, Vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
inline Vf vmask(uint32_t m, Vf a) { return _mm512_maskz_mov_ps(static_cast<__mmask16>(m), a); }
inline Vf vadd(Vf a, Vf b) { return _mm512_add_ps(a, b); }
inline Vf vmul(Vf a, Vf b) { return _mm512_mul_ps(a, b); }
inline Vf vmin(Vf a, Vf b) { return _mm512_min_ps(a, b); }
inline Vf vzero() { return _mm512_setzero_ps(); }
struct Vd {  // the 16 lanes widened to double
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  void add(Vf a) {
    lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(a)));
    hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1))));
  }
  double sum() const { return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi)); }
};
#else  // AVX2 (sample.cpp's kernel refuses a build without it)
constexpr int kL = 8;
using Vf = __m256;
inline Vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vf vset(float x) { return _mm256_set1_ps(x); }
inline uint32_t vge(Vf a, Vf b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GE_OQ)); }
inline Vf vmask(uint32_t m, Vf a) {
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(m)), bit), bit);
  return _mm256_and_ps(_mm256_castsi256_ps(on), a);
}
inline Vf vadd(Vf a, Vf b) { return _mm256_add_ps(a, b); }
inline Vf vmul(Vf a, Vf b) { return _mm256_mul_ps(a, b); }
inline Vf vmin(Vf a, Vf b) { return _mm256_min_ps(a, b); }
inline Vf vzero() { return _mm256_setzero_ps(); }
struct Vd {
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  void add(Vf a) {
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(a)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)));
  }
  double sum() const {
    alignas(32) double l[4];
    _mm256_store_pd(l, _mm256_add_pd(lo, hi));
    return (l[0] + l[1]) + (l[2] + l[3]);
  }
};
#endif

// Appends the lanes of x, e and their ids (j, j + 1, ...) picked by mask m to cs, ce, cid: whole vectors are
// stored (the buffers have kL spare entries), the count advances by the picked ones.
#ifdef __AVX512F__
inline int64_t compress(uint32_t m, Vf x, Vf e, int64_t j, float* cs, float* ce, uint32_t* cid) {
  const __mmask16 k = static_cast<__mmask16>(m);
  _mm512_storeu_ps(cs, _mm512_maskz_compress_ps(k, x));
  _mm512_storeu_ps(ce, _mm512_maskz_compress_ps(k, e));
  const __m512i ids = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(j)),
                                       _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  _mm512_storeu_si512(cid, _mm512_maskz_compress_epi32(k, ids));
  return __builtin_popcount(m);
}
#else
// AVX2 has no compress: a table of the permutations that move the picked lanes of each 8-bit mask to the front.
struct Moves {
  alignas(32) int32_t to[256][8];
  Moves() {
    for (int m = 0; m < 256; ++m) {
      int n = 0;
      for (int l = 0; l < 8; ++l)
        if (m >> l & 1) to[m][n++] = l;
      for (; n < 8; ++n) to[m][n] = 0;
    }
  }
};
inline const Moves kMoves;
inline int64_t compress(uint32_t m, Vf x, Vf e, int64_t j, float* cs, float* ce, uint32_t* cid) {
  const __m256i p = _mm256_load_si256(reinterpret_cast<const __m256i*>(kMoves.to[m]));
  _mm256_storeu_ps(cs, _mm256_permutevar8x32_ps(x, p));
  _mm256_storeu_ps(ce, _mm256_permutevar8x32_ps(e, p));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(cid), _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(j)), p));
  return __builtin_popcount(m);
}
#endif

inline float lanes_sum(Vf a) {
  alignas(64) float l[kL];
  std::memcpy(l, &a, sizeof a);
  float t = 0.f;
  for (const float x : l) t += x;
  return t;
}

constexpr int kProbes = 8;

// For thresholds t[0] > ... > t[7]: the count and (roughly: float lanes) the e-mass of {i : s[i] >= t[k]}.
inline void probe(const float* s, const float* ex, int64_t V, const float* t, double* mass, int64_t* count) {
  Vf acc[kProbes], tv[kProbes];
  int64_t n[kProbes] = {0};
  for (int k = 0; k < kProbes; ++k) acc[k] = vzero(), tv[k] = vset(t[k]);
  int64_t j = 0;
  for (; j + kL <= V; j += kL) {
    const Vf x = vload(s + j), e = vload(ex + j);
    for (int k = 0; k < kProbes; ++k) {
      const uint32_t m = vge(x, tv[k]);
      acc[k] = vadd(acc[k], vmask(m, e));
      n[k] += __builtin_popcount(m);
    }
  }
  for (int k = 0; k < kProbes; ++k) {
    mass[k] = lanes_sum(acc[k]);
    for (int64_t i = j; i < V; ++i)
      if (s[i] >= t[k]) mass[k] += ex[i], ++n[k];
    count[k] = n[k];
  }
}

struct Work {
  std::vector<uint32_t> above, bracket, sort_scratch, ids;  // ids: the kept tokens, the first max first
  int64_t uncertain = 0;  // how many of ids, at its end, torch may have cut (bounded_cut's moving_ok)
  std::vector<uint32_t> cid;                                // the tokens the cut can fall among, and their
  std::vector<float> cs, ce;                                // scaled values and exps
  std::vector<char> keep;                                  // min_p's verdict on each of ids
};

inline float round_down(double x) {
  const float f = static_cast<float>(x);
  return f > x ? std::nextafter(f, -INFINITY) : f;
}
inline float round_up(double x) {
  const float f = static_cast<float>(x);
  return f < x ? std::nextafter(f, INFINITY) : f;
}

// fl32(before) < top_p, or -1 when before's error eps could change the answer.
inline int below(double before, double eps, float top_p) {
  const bool lo = static_cast<float>(before - eps) < top_p, hi = static_cast<float>(before + eps) < top_p;
  return lo == hi ? lo : -1;
}

// The cut at one inv: the kept count K (the first position j >= 1 whose mass before is not < top_p, or V),
// or -1 if not proven. `mass_above` is the float64 mass of the `a` tokens >= hi.
inline int64_t cut_at(const float* ex, int64_t V, const std::vector<uint32_t>& bracket, int64_t a, double mass_above,
                      float inv, float top_p) {
  double before = mass_above;
  const double eps = 2.2 * static_cast<double>(V) * 0x1p-53;  // times max(1, before)
  int64_t pos = a;
  // A mass not below top_p at the bracket's first position puts the cut at or above it, among the tokens >= hi,
  // whose masses were not walked: not proven.
  for (const uint32_t id : bracket) {
    if (pos > 0) {
      const int b = below(before, eps * std::max(1.0, before), top_p);
      if (b < 0 || (!b && pos == a)) return -1;
      if (!b) return pos;
    }
    before += static_cast<double>(ex[id] * inv);
    ++pos;
  }
  if (pos == V) return V;
  // Else the thresholds' float masses misled: the cut lies below the bracket (or above it, as before).
  return pos > a && below(before, eps * std::max(1.0, before), top_p) == 0 ? pos : -1;
}

// One pass over a row v (finite, max m, temperature T): the scaled values s = (v - m) / T (sampling._scaled,
// one rounding per op), their exps ex (torch's bits: torch_softmax.h), their sum S in float64 (exact to
// V 2^-53) and the smallest s. One pass where three were: the row is read once while it is in L1.
inline void scaled_exps(const float* v, int64_t V, float m, float T, float* s, float* ex, double& S, float& smin) {
  Vd total;
  Vf low = vset(INFINITY);
  const Vf mv = vset(m), tv = vset(T);
  int64_t j = 0;
  for (; j + kL <= V; j += kL) {
#ifdef __AVX512F__
    const Vf x = _mm512_div_ps(_mm512_sub_ps(vload(v + j), mv), tv);
    _mm512_storeu_ps(s + j, x);
#else
    const Vf x = _mm256_div_ps(_mm256_sub_ps(vload(v + j), mv), tv);
    _mm256_storeu_ps(s + j, x);
#endif
    const Vf e = sluice_softmax::expf_u10(x);
    std::memcpy(ex + j, &e, sizeof e);
    total.add(e);
    low = vmin(low, x);  // NaN-free: the row is finite
  }
  S = total.sum();
  alignas(64) float l[kL];
  std::memcpy(l, &low, sizeof low);
  smin = *std::min_element(l, l + kL);
  for (; j < V; ++j) {
    s[j] = (v[j] - m) / T;
    ex[j] = sluice_softmax::expf_u10(s[j]);
    S += ex[j];
    smin = std::min(smin, s[j]);
  }
}

// Fills w.ids (the kept tokens: `first`, the first max, leads) and w.keep from the scaled row s and its
// exps ex (torch's bits), or returns false. W: torch's softmax lanes (8 or 16); S, smin: scaled_exps'.
// moving_ok: where the cuts at the bracket's two ends differ (each proven), torch's lies between them (the cut
// moves one way as inv does), so ids holds the longer one and w.uncertain counts its last tokens that the
// shorter one cuts; else (and without moving_ok) such a row returns false. w.uncertain is 0 otherwise.
inline bool bounded_cut(const float* s, const float* ex, int64_t V, int W, int64_t first, float top_p, float min_p,
                        double S, float smin, Work& w, bool moving_ok = false) {
  w.uncertain = 0;
  // torch's S within S +- err (the header comment's bound, split at sigma): a token below sigma changes its
  // lane's sum by at most itself; the N tokens at or above sigma are the first N of the sorted row, so no lane
  // holds more than ceil(N / W) of them, each rounding by at most 2^-24 of a lane's sum (and the lanes' sums
  // add up to S). sigma = log(2^-24 S / W) balances the two. A row shorter than W is one lane, left to right.
  const int lanes = V < W ? 1 : W;
  const float sigma = static_cast<float>(std::log(std::ldexp(S / lanes, -24)));
  // The same pass keeps the tokens the cut can fall among, their values and exps side by side (the rest of this
  // function reads those few hundred floats, not the row). Every token below floor_s has e < 2 e^floor_s (Sleef's exp is within an ulp), so all of them together
  // hold under 2 V e^floor_s = (1 - top_p) S / 4 of the mass, and the cut lies above them. floor_s only picks
  // where the search starts: cut_at checks its result whatever it is.
  const float floor_s = std::max(smin, static_cast<float>(std::log((1.0 - top_p) * S / (8.0 * V))));
  const Vf sv = vset(sigma), fv = vset(floor_s);
  Vf small = vzero();
  int64_t n_big = 0, n = 0;
  w.cid.resize(V + kL);
  w.cs.resize(V + kL);
  w.ce.resize(V + kL);
  float *cs = w.cs.data(), *ce = w.ce.data();
  uint32_t* cid = w.cid.data();
  int64_t j = 0;
  for (; j + kL <= V; j += kL) {
    const Vf x = vload(s + j), e = vload(ex + j);
    const uint32_t big = vge(x, sv);
    n_big += __builtin_popcount(big);
    small = vadd(small, vmask(~big, e));
    if (const uint32_t keep = vge(x, fv)) n += compress(keep, x, e, j, cs + n, ce + n, cid + n);
  }
  double below_sigma = lanes_sum(small);
  for (; j < V; ++j) {
    if (s[j] >= sigma) ++n_big;
    else below_sigma += ex[j];
    if (s[j] >= floor_s) cs[n] = s[j], ce[n] = ex[j], cid[n++] = static_cast<uint32_t>(j);
  }
  // times 1.01 + 2 V 2^-24: the float sums (torch's partial sums, and this pass's) may be off by their own error
  const double slack = 1.01 + std::ldexp(2.0 * V, -24);
  const double err = (below_sigma + std::ldexp(S * static_cast<double>((n_big + lanes - 1) / lanes + std::log2(lanes)), -24)) * slack +
                     std::ldexp(S * static_cast<double>(V), -51);
  const float inv[2] = {1.0f / round_up(S + err), 1.0f / round_down(S - err)};

  // The bracket: mass(>= hi) < top_p S <= mass(>= lo) by the float masses (checked exactly below).
  const double target = static_cast<double>(top_p) * S;
  float hi = INFINITY, lo = floor_s;
  int64_t n_hi = 0, n_lo = n;
  for (int pass = 0; pass < 6 && n_lo - n_hi > 32; ++pass) {
    const float top = hi == INFINITY ? 0.f : hi;
    if (!(lo < top)) break;
    float t[kProbes];
    double mass[kProbes];
    int64_t count[kProbes];
    for (int k = 0; k < kProbes; ++k) t[k] = top + (lo - top) * (static_cast<float>(k + 1) / (kProbes + 1));
    probe(cs, ce, n, t, mass, count);
    int k = 0;
    while (k < kProbes && mass[k] < target) ++k;
    if (k < kProbes) lo = t[k], n_lo = count[k];
    if (k > 0) hi = t[k - 1], n_hi = count[k - 1];
  }

  // The tokens >= hi (their float64 masses at both inv) and the bracket, in id order.
  w.above.clear();
  w.bracket.clear();
  Vd above[2];
  const Vf hv = vset(hi), lv = vset(lo), i0 = vset(inv[0]), i1 = vset(inv[1]);
  for (j = 0; j + kL <= n; j += kL) {
    const Vf x = vload(cs + j), e = vload(ce + j);
    const uint32_t up = vge(x, hv), in = vge(x, lv) & ~up;
    if (up) {
      above[0].add(vmask(up, vmul(e, i0)));
      above[1].add(vmask(up, vmul(e, i1)));
      for (uint32_t m = up; m; m &= m - 1) w.above.push_back(cid[j + __builtin_ctz(m)]);
    }
    for (uint32_t m = in; m; m &= m - 1) w.bracket.push_back(cid[j + __builtin_ctz(m)]);
  }
  double mass_above[2] = {above[0].sum(), above[1].sum()};
  for (; j < n; ++j) {
    if (cs[j] >= hi) {
      for (int q = 0; q < 2; ++q) mass_above[q] += static_cast<double>(ce[j] * inv[q]);
      w.above.push_back(cid[j]);
    } else if (cs[j] >= lo) {
      w.bracket.push_back(cid[j]);
    }
  }
  const int64_t a = static_cast<int64_t>(w.above.size());
  const int64_t nb = static_cast<int64_t>(w.bracket.size());
  if (nb <= 64) sluice_radix::sort_few_ids_descending(s, w.bracket.data(), nb);
  else sluice_radix::sort_ids_descending(s, w.bracket.data(), nb, w.sort_scratch);
  // inv[0] < inv[1]: every mass is smaller at inv[0], so its cut K is the longer (or the same).
  const int64_t K = cut_at(ex, V, w.bracket, a, mass_above[0], inv[0], top_p);
  if (K < 0) return false;
  const int64_t K1 = cut_at(ex, V, w.bracket, a, mass_above[1], inv[1], top_p);
  if (K1 < 0 || K1 > K || (K1 != K && !moving_ok)) return false;
  // Ranks K1 .. K - 1 may or may not be torch's: bracket tokens, never the first max (rank 0 < K1), so they are
  // the last K - K1 of ids below, in rank order.

  // The kept tokens; min_p keeps fl(e inv) >= fl(min_p inv) (torch's p_0 is exp(0) inv = inv): for every
  // inv that is e >= min_p, unless e is within 2^-22 below min_p, where the roundings may tie them.
  w.ids.clear();
  w.keep.clear();
  w.ids.push_back(static_cast<uint32_t>(first));
  for (const uint32_t id : w.above)
    if (id != first) w.ids.push_back(id);
  for (int64_t q = 0; q < K - a; ++q)
    if (w.bracket[q] != first) w.ids.push_back(w.bracket[q]);
  const float band = static_cast<float>(min_p * (1.0 - 0x1p-22));
  for (size_t q = 0; q < w.ids.size(); ++q) {
    const float e = ex[w.ids[q]];
    if (q == 0 || min_p <= 0.f || e >= min_p) w.keep.push_back(1);
    else if (e < band) w.keep.push_back(0);
    else return false;
  }
  w.uncertain = K - K1;  // (set only here: a row that returns false leaves it 0)
  ++(w.uncertain ? moving : bounded);
  return true;
}

}  // namespace sluice_top_p
