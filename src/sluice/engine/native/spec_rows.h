// The filtered rows of a speculative round (accept.cpp): RoundProbs' probabilities of a row with
// temperature and top_p alone, torch's bits, for the verify's p and the draft's q.
//
// Why a header: the exps, the softmax sums and the top_p cut are most of a sampled round's non-forward
// time on the bundled model (8,192 tokens a row, a row per draft guess and per verified position). The
// exps run 16 or 8 lanes at a time (torch_softmax.h's vector expf_u10: the same bits as the scalar one);
// top_p takes top_p_cut.h's bounded cut, which proves torch's cut without sorting the row, or (moving_ok) proves
// it to within a few tokens, for a caller that then decides under each of those cuts (accept.cpp); it sorts the
// row (as before) only where neither holds.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "radix.h"
#include "row_max.h"
#include "top_p_cut.h"
#include "torch_softmax.h"

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace sluice_spec {

// torch's reduce_all(+) of e in lanes of W (a compile-time 8 or 16): lane l the float sum of e[l], e[l + W],
// ... in order (from 0: 0 + e == e for e >= 0), then folded.
template <int W>
float lane_sum_w(const float* e, int64_t n) {
  float acc[16] = {0.f};
  int64_t j = 0;
  for (; j + W <= n; j += W)
    for (int l = 0; l < W; ++l) acc[l] += e[j + l];
  for (int l = 0; j < n; ++j, ++l) acc[l] += e[j];
  return sluice_softmax::fold_lanes(acc, W);
}

// torch's reduce_all(+) of e (torch_softmax.h): W lanes, lane l the float sum of e[l], e[l + W], ... in
// order, then folded; a row shorter than W left to right. order: the positions' ids (nullptr: 0..n-1).
inline float lane_sum(const float* e, const uint32_t* order, int64_t n, int W) {
  float acc[16] = {0.f};
  if (n < W) {
    for (int64_t j = 0; j < n; ++j) acc[0] = j ? acc[0] + e[order ? order[j] : j] : e[order ? order[j] : j];
    return acc[0];
  }
  if (order == nullptr) return W == 16 ? lane_sum_w<16>(e, n) : lane_sum_w<8>(e, n);
  // lane l: e[order[l]], then + e[order[l + W]], ... (from 0: 0 + e == e for e >= 0), W positions a step
  int64_t j = 0;
  for (; j + W <= n; j += W)
    for (int l = 0; l < W; ++l) acc[l] += e[order[j + l]];
  for (int l = 0; j < n; ++j, ++l) acc[l] += e[order[j]];
  return sluice_softmax::fold_lanes(acc, W);
}

struct Nucleus {  // scratch of one thread
  std::vector<float> s, e, alt;
  std::vector<uint32_t> ids, sort_scratch;
  sluice_top_p::Work cut;
  // nucleus_row's moving_ok: how many of the longest cut's last kept tokens (the last of cut.ids, by rank) torch
  // may have cut (0: the cut is exact), and the kept tokens' exps in vocabulary order, zeros elsewhere (in s)
  int64_t uncertain = 0;
};

// RoundProbs' row for a sampled row with temperature T and top_p alone (1: off), no penalties: the scaled
// logits s = (x - max) / T, filter_logits' top_p cut (its stable descending sort, torch's softmax of the
// sorted row, the cumulative mass accumulated in double and rounded to float as ATen's cumsum does), then
// torch's softmax of the kept tokens in vocabulary order. Every step is the float operation torch does, in
// its order, so the same bits. The cut is top_p_cut.h's bounded one where it proves torch's, else the sort.
// W: the lanes of torch's softmax sum (8 or 16). False (out unset) on a non-finite logit, where the torch
// path decides. moving_ok: a cut proven only to within a few tokens may stand: out is then the row of the
// longest such cut, w.uncertain > 0, and nucleus_variant gives the others (the caller takes a decision only
// where every one of them gives it).
inline bool nucleus_row(const float* x, int64_t V, float T, float top_p, int W, float* out, Nucleus& w,
                        bool moving_ok = false) {
  w.uncertain = 0;
  const int64_t first = sluice_rows::finite_first_max(x, V);  // the first max: s = 0 there, and the stable sort puts it first
  if (first < 0) return false;  // a NaN or an inf
  const float m = x[first];
  w.s.resize(V);
  w.e.resize(V);
  float *s = w.s.data(), *e = w.e.data();
  double S;  // the exps' sum and the row's least s, both of which the bounded cut reads
  float smin;
  sluice_top_p::scaled_exps(x, V, m, T, s, e, S, smin);  // s = sampling._scaled: the max's s is exactly 0
  if (top_p < 1.f) {
    const uint32_t* kept_ids;
    int64_t kept;
    if (sluice_top_p::bounded_cut(s, e, V, W, first, top_p, 0.f, S, smin, w.cut, moving_ok)) {
      kept_ids = w.cut.ids.data();
      kept = static_cast<int64_t>(w.cut.ids.size());
      w.uncertain = w.cut.uncertain;
    } else {
      ++sluice_top_p::sorted;
      w.ids.resize(V);
      for (int64_t i = 0; i < V; ++i) w.ids[i] = static_cast<uint32_t>(i);
      sluice_radix::sort_ids_descending(s, w.ids.data(), V, w.sort_scratch);
      const float inv = 1 / lane_sum(e, w.ids.data(), V, W);  // the sorted row's softmax: its max is s = 0 too
      double mass = 0;
      for (kept = 0; kept < V; ++kept) {
        if (kept && !(static_cast<float>(mass) < top_p)) break;
        mass += static_cast<double>(e[w.ids[kept]] * inv);
      }
      kept_ids = w.ids.data();
    }
    if (kept < V || w.uncertain) {  // the softmax over the kept tokens alone, in vocabulary order: the rest count 0
      std::vector<float>& masked = w.s;  // s is no longer needed
      std::fill(masked.begin(), masked.end(), 0.f);
      for (int64_t j = 0; j < kept; ++j) masked[kept_ids[j]] = e[kept_ids[j]];
      e = masked.data();
    }
  }
  const float inv = 1 / lane_sum(e, nullptr, V, W);
  for (int64_t i = 0; i < V; ++i) out[i] = e[i] * inv;
  return true;
}

// After nucleus_row left w.uncertain > 0: the row of the cut that drops the last `drop` (1..w.uncertain) of the
// uncertain tokens, into out: the same softmax over the fewer kept tokens.
inline void nucleus_variant(int64_t V, int W, int64_t drop, float* out, Nucleus& w) {
  w.alt.assign(w.s.begin(), w.s.begin() + V);
  for (int64_t i = 1; i <= drop; ++i) w.alt[w.cut.ids[w.cut.ids.size() - i]] = 0.f;
  const float inv = 1 / lane_sum(w.alt.data(), nullptr, V, W);
  for (int64_t i = 0; i < V; ++i) out[i] = w.alt[i] * inv;
}

}  // namespace sluice_spec
