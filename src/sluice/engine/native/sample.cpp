// One step of the batch sampler in one call (engine/sample.py wraps it; engine/sampling.py's torch path is
// the reference it must equal, token for token).
//
// Why: the torch path is ~40 small ops a step (0.36 ms at 8 rows), while the work is a few scans of each
// row. The catch is exactness. The steps that only pick or compare (penalties, max, temperature, top-k,
// the candidates' order) are done here with the same single float operations torch does, so they give
// the same bits. The steps that go through a transcendental (the softmax under top_p / min_p, the log
// noise of the race) are computed here in double, with a bound on how far torch's float results can be
// from the exact ones; a decision is taken only when the bound shows torch takes the same one. Where it
// cannot (a mass within ~1e-5 of top_p, two race keys within ~1e-5), or where the row is odd (NaN / inf),
// the call changes nothing and says "defer", and the caller runs the torch path. Those are rare, so the
// answer is always torch's. top_p with top_k off is the exception to the bounds: its softmax runs over the
// whole row, where a float sum's error bound is too loose to decide on, so top_p_prefix reproduces torch's
// probabilities bit for bit instead (torch_softmax.h).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "radix.h"
#include "row_max.h"
#include "simd.h"
#include "torch_softmax.h"

// torch rounds every elementwise op on its own; a fused multiply-add here would round differently.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "top_p_cut.h"  // after the pragma: its probabilities are torch's single roundings too

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
// Bounds on torch's float error: Sleef's exp and log (torch's vectorised ones) claim 1 ulp, these allow 4
// (softmax over 40 values measured <= 6 * 2^-24 from exact, all its roundings together).
constexpr double kExpErr = 0x1p-21;  // relative, per exp
constexpr double kLogErr = 0x1p-21;  // relative, per log
constexpr double kUlp = 0x1p-23;
constexpr double kSkipMargin = 1e-3;   // a token whose key bound is this far below the leader cannot win

inline uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// noise.py's definition: the 24 random bits of token t at a draw with base b (u = bits * 2^-24).
inline uint32_t noise_bits(uint64_t base, int64_t t) {
  return static_cast<uint32_t>(mix(base + (static_cast<uint64_t>(t) + 1) * kGolden) >> 40);
}

// The race key of a scaled logit s: s - log E, E = -log max(u, FLT_MIN), in double.
inline double race_key(double s, uint32_t bits, double& log_e) {
  const double u = std::max(static_cast<double>(bits) * 0x1p-24, static_cast<double>(std::numeric_limits<float>::min()));
  log_e = std::log(-std::log(u));
  return s - log_e;
}

// How far torch's float key (s - log(-log u), three roundings and two logs) can be from race_key's.
inline double key_tolerance(double key, double log_e) {
  return kLogErr * (1.0 + std::fabs(log_e)) + 2 * kUlp * std::fabs(key) + 1e-30;
}

// An upper bound on the noise term -log E of a token (the race's pruning): -log(-log u) <= -log(1 - u),
// and -log(1 - u) = (24 - log2 m) ln 2 with m = 2^24 - bits >= 1, at most (24 - floor(log2 m)) ln 2. In
// float ops only (exact: m < 2^25; ln 2 rounded up), so a loop of it vectorises.
inline float noise_bound(uint32_t bits) {
  const float mm = static_cast<float>((1u << 24) - bits);
  int32_t e;
  std::memcpy(&e, &mm, sizeof e);
  return static_cast<float>(24 - ((e >> 23) - 127)) * 0.6931472f;
}

struct Rival {  // a token that may win the race: its key, how far torch's can be from it
  double key, tol;
  int64_t id;
};

// The race's winner among `rivals` (the first is the leader the other tokens were pruned against: their
// keys fall short of its by more than both tolerances), or -1 when some rival's key comes within the two
// tolerances of the winner's (torch's float keys may then rank them either way).
int64_t certain_winner(const std::vector<Rival>& rivals) {
  Rival best = rivals[0];
  for (const Rival& c : rivals)
    if (c.key > best.key) best = c;
  for (const Rival& c : rivals)
    if (c.id != best.id && c.key + c.tol >= best.key - best.tol) return -1;
  return best.id;
}

// The lanes this build has (simd.h's choice: AVX-512, else AVX2) and the few operations the scans need.
#ifdef __AVX512F__
constexpr int kW = 16;
using Lanes = __m512;
inline Lanes load(const float* p) { return _mm512_loadu_ps(p); }
inline Lanes splat(float x) { return _mm512_set1_ps(x); }
inline Lanes lanes_max(Lanes a, Lanes b) { return _mm512_max_ps(a, b); }
inline float top(Lanes a) { return _mm512_reduce_max_ps(a); }
inline uint32_t ge(Lanes a, Lanes b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
inline Lanes where_below(Lanes a, Lanes t, Lanes e) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, t, _CMP_LT_OQ), e); }
inline Lanes add(Lanes a, Lanes b) { return _mm512_add_ps(a, b); }
inline void store(float* p, Lanes a) { _mm512_storeu_ps(p, a); }
#else  // AVX2: the extension refuses a build without it
constexpr int kW = 8;
using Lanes = __m256;
inline Lanes load(const float* p) { return _mm256_loadu_ps(p); }
inline Lanes splat(float x) { return _mm256_set1_ps(x); }
inline Lanes lanes_max(Lanes a, Lanes b) { return _mm256_max_ps(a, b); }
inline float top(Lanes a) {
  alignas(32) float l[8];
  _mm256_store_ps(l, a);
  return *std::max_element(l, l + 8);
}
inline uint32_t ge(Lanes a, Lanes b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GE_OQ)); }
inline Lanes where_below(Lanes a, Lanes t, Lanes e) { return _mm256_and_ps(_mm256_cmp_ps(a, t, _CMP_LT_OQ), e); }
inline Lanes add(Lanes a, Lanes b) { return _mm256_add_ps(a, b); }
inline void store(float* p, Lanes a) { _mm256_storeu_ps(p, a); }
#endif

// The row's largest value, whether all are finite, and the first index of the max (of a finite row; 0 otherwise):
// row_max.h's scans, which select.cpp and the speculative calls share.
void scan_max(const float* p, int64_t V, float& best, bool& finite, int64_t& first) {
  sluice_rows::max_and_finite(p, V, best, finite);
  first = finite ? sluice_rows::first_index_of(p, V, best) : 0;
}

struct Cand {
  float value;
  int64_t id;
};
inline bool ranks_before(const Cand& a, const Cand& b) { return a.value > b.value || (a.value == b.value && a.id < b.id); }

// Appends every i with p[i] >= t to out, in id order.
void at_least(const float* p, int64_t V, float t, std::vector<Cand>& out) {
  int64_t j = 0;
  for (const Lanes tv = splat(t); j + kW <= V; j += kW)
    for (uint32_t hit = ge(load(p + j), tv); hit; hit &= hit - 1) {
      const int64_t i = j + __builtin_ctz(hit);
      out.push_back({p[i], i});
    }
  for (; j < V; ++j)
    if (p[j] >= t) out.push_back({p[j], j});
}

// The k + 1 best of a finite row (k + 1 <= V), in the order of a stable descending sort. The (k+1)-th
// largest of the maxima of >= k + 1 chunks has k + 1 values at or above it, so every one of the k + 1
// best is too: two scans and a sort of the few values above that threshold (a heap over the row cost
// ~25 us a row at k = 40, its ~200 replacements each a few cache-missing sifts).
void top_k1(const float* p, int64_t V, int64_t k, std::vector<Cand>& out, std::vector<float>& maxima) {
  const int64_t want = k + 1, chunk = std::max<int64_t>(1, V / (4 * want)), n = (V + chunk - 1) / chunk;
  maxima.resize(n);
  bool finite;
  for (int64_t c = 0; c < n; ++c) sluice_rows::max_and_finite(p + c * chunk, std::min(chunk, V - c * chunk), maxima[c], finite);
  std::nth_element(maxima.begin(), maxima.begin() + (want - 1), maxima.end(), std::greater<float>());
  out.clear();
  at_least(p, V, maxima[want - 1], out);
  std::partial_sort(out.begin(), out.begin() + want, out.end(), ranks_before);
  out.resize(want);
}

struct Row {
  float temperature, top_p, min_p, penalty, presence, frequency;
  int64_t top_k;  // 0: a greedy row; V: top_k off
};

struct Scratch {
  std::vector<float> pen;  // the penalised row
  std::vector<Cand> heap, cand;
  std::vector<float> maxima, hi, ex;
  std::vector<uint32_t> head, sort_scratch;
  std::vector<double> e;
  std::vector<char> keep;
  std::vector<Rival> rivals;
  sluice_top_p::Work cut;
  int64_t uncertain = 0;  // top_p_prefix: how many of cand, at its end, torch may have cut
};

// This thread's buffers, kept from call to call: allocating and zeroing a row's worth each step cost more
// than some rows' whole draw.
Scratch& thread_scratch() {
  thread_local Scratch w;
  return w;
}

// The head of a row for torch's softmax sum: the ids whose scaled value is >= t, in id order, and the largest
// e of the rest (0 if none).
float split_head(const float* s, const float* ex, int64_t V, float t, std::vector<uint32_t>& head) {
  head.clear();
  int64_t j = 0;
  Lanes tails = splat(0.f);
  for (const Lanes tv = splat(t); j + kW <= V; j += kW) {
    const Lanes x = load(s + j);
    tails = lanes_max(tails, where_below(x, tv, load(ex + j)));
    for (uint32_t hit = ge(x, tv); hit; hit &= hit - 1) head.push_back(static_cast<uint32_t>(j + __builtin_ctz(hit)));
  }
  float tail = top(tails);
  for (; j < V; ++j)
    if (s[j] >= t) head.push_back(static_cast<uint32_t>(j));
    else tail = std::max(tail, ex[j]);
  return tail;
}

// torch's softmax sum S over the row in stable descending order (torch_softmax.h), from the sorted head
// alone, or NaN when the tail might change it. Every tail token ranks after the head, so it is added to its
// lane after the lane's head tokens; one below half an ulp of that lane's sum leaves the sum as it is.
float head_sum(const float* ex, const std::vector<uint32_t>& head, int64_t V, int W, float tail) {
  const int64_t n = static_cast<int64_t>(head.size());
  if (V < W) {  // reduce_all's short row: left to right (the head is the whole row here)
    float acc = 0.f;
    for (int64_t j = 0; j < n; ++j) acc = j == 0 ? ex[head[0]] : acc + ex[head[j]];
    return acc;
  }
  float acc[16] = {0.f};
  for (int64_t j = 0; j < n; ++j) acc[j & (W - 1)] = j < W ? ex[head[j]] : acc[j & (W - 1)] + ex[head[j]];
  for (int l = 0; tail > 0.f && l < W; ++l) {
    // A lane with no head token holds tail tokens only: exact (zeros) only when the tail is all zeros.
    if (l >= n || !(2 * tail < std::nextafter(acc[l], INFINITY) - acc[l])) return NAN;
  }
  return sluice_softmax::fold_lanes(acc, W);
}

// Sampled row with top_p and top_k off: filtering._candidates' kept prefix, exactly. Its probabilities are
// torch's bits (torch_softmax.h); the mass before each token is the cumulative sum's, which accumulates in
// double and rounds to float (ATen's CPU cumsum of fp32); top_p, then min_p on the same probabilities.
// Most rows are cut without a sort (top_p_cut.h); the others sort the head of the row: the tokens that can
// change torch's sum S, which is all the cut needs besides the few tokens before it. W is the lane count of
// torch's vectorised softmax (8 or 16; 0: unknown, defer). Fills w.cand (scaled value, id; the first max,
// `first`, leads) and w.keep; false to defer. moving_ok: a cut proven only to lie within a few tokens may
// stand, the longest of them in w.cand with w.uncertain its last tokens that torch may have cut (race_row
// then checks its winner is not one of them); else w.uncertain is 0.
bool top_p_prefix(const float* v, int64_t V, float m, int64_t first, const Row& r, int W, Scratch& w, bool moving_ok) {
  w.uncertain = 0;
  if (W != 8 && W != 16) return false;
  w.hi.resize(V);
  w.ex.resize(V);
  float *s = w.hi.data(), *ex = w.ex.data();
  double total;  // S in float64
  float smin;
  sluice_top_p::scaled_exps(v, V, m, r.temperature, s, ex, total, smin);
  if (sluice_top_p::bounded_cut(s, ex, V, W, first, r.top_p, r.min_p, total, smin, w.cut, moving_ok)) {
    w.uncertain = w.cut.uncertain;
    w.cand.clear();
    for (const uint32_t id : w.cut.ids) w.cand.push_back({s[id], id});
    w.keep.assign(w.cut.keep.begin(), w.cut.keep.end());
    return true;
  }
  ++sluice_top_p::sorted;
  // A first guess at the head: e >= S 2^-40. Random logits at T = 0.8 needed ~90% of 8,192 tokens, and a
  // guess of 2^-31 (half an ulp of a lane holding a 64th of S) fell short in half the rows: a second sort.
  float t = V < W ? -INFINITY : static_cast<float>(std::log(total) - 40 * M_LN2);
  for (int attempt = 0;; ++attempt) {
    const float tail = split_head(s, ex, V, t, w.head);
    sluice_radix::sort_ids_descending(s, w.head.data(), static_cast<int64_t>(w.head.size()), w.sort_scratch);
    const float S = head_sum(ex, w.head, V, W, tail);
    if (std::isnan(S)) {  // the tail reaches a lane's rounding: take more of the row (all of it at the end)
      if (t == -INFINITY) return false;  // (no tail then: cannot happen)
      t = attempt < 3 ? t - 8.f : -INFINITY;
      continue;
    }
    const float inv = 1 / S, p0 = ex[w.head[0]] * inv, floor_p = r.min_p * p0;
    w.cand.clear();
    w.keep.clear();
    double before = 0;
    bool cut = false;
    for (const uint32_t id : w.head) {
      if (!w.cand.empty() && !(static_cast<float>(before) < r.top_p)) {
        cut = true;
        break;
      }
      const float p = ex[id] * inv;
      w.cand.push_back({s[id], id});
      w.keep.push_back(w.cand.size() == 1 || r.min_p <= 0.f || p >= floor_p);
      before += p;
    }
    if (cut || static_cast<int64_t>(w.head.size()) == V) return true;
    t = -INFINITY;  // top_p above the head's mass: the cut lies in the tail, so sort the whole row
  }
}

// The race among w.cand's kept tokens: the first (always kept) leads, and a bound on each other's key spares
// most of them the logs.
int64_t race_kept(Scratch& w, uint64_t base) {
  double le;
  const double lead = race_key(w.cand[0].value, noise_bits(base, w.cand[0].id), le), lead_tol = key_tolerance(lead, le);
  const float reach = static_cast<float>(lead - lead_tol - kSkipMargin) - 1e-3f;
  w.rivals.assign(1, {lead, lead_tol, w.cand[0].id});
  for (size_t j = 1; j < w.cand.size(); ++j) {
    if (!w.keep[j] || w.cand[j].value == kNegInf) continue;
    const uint32_t bits = noise_bits(base, w.cand[j].id);
    if (w.cand[j].value + noise_bound(bits) < reach) continue;
    const double key = race_key(w.cand[j].value, bits, le);
    w.rivals.push_back({key, key_tolerance(key, le), w.cand[j].id});
  }
  return certain_winner(w.rivals);
}

// Sampled row: the exponential race over the tokens the filters keep. Returns the token, or -1 to defer.
int64_t race_row(const float* v, int64_t V, float m, int64_t first, const Row& r, uint64_t base, int W, Scratch& w) {
  const float T = r.temperature;
  auto scaled = [&](float x) { return (x - m) / T; };  // sampling._scaled, one rounding per op as torch
  const bool top_p = r.top_p < 1.f, min_p = r.min_p > 0.f;
  if (min_p && r.min_p < 1e-30f) return -1;  // its threshold probabilities would be subnormal floats
  if (r.top_k >= V) {  // every token is a candidate
    if (top_p) {
      if (!top_p_prefix(v, V, m, first, r, W, w, true)) return -1;
      const int64_t id = race_kept(w, base);
      const auto last = w.cand.end() - w.uncertain;
      if (id < 0 || std::none_of(last, w.cand.end(), [&](const Cand& c) { return c.id == id; })) return id;
      // The winner is a token torch's cut may drop: cut exactly (the sort) and race again.
      return top_p_prefix(v, V, m, first, r, W, w, false) ? race_kept(w, base) : -1;
    }
    // min_p keeps p_i >= min_p p_max, i.e. exp(s_i) >= min_p (p_max = exp(0) / sum): a threshold on s.
    const double t = min_p ? std::log(static_cast<double>(r.min_p)) : -INFINITY;
    const double slack = 2 * kExpErr + 8 * kUlp;
    // The first max (s = 0) always races: its key is the one to beat.
    double lead_le;
    const double lead = race_key(0.0, noise_bits(base, first), lead_le);
    const double skip_below = lead - key_tolerance(lead, lead_le) - kSkipMargin;
    // An upper bound on every token's key (its scaled value plus the noise bound above), in one loop without
    // branches that the compiler vectorises; only tokens whose bound reaches the lead's key are looked at.
    w.hi.resize(V);
    float* hi = w.hi.data();
    for (int64_t i = 0; i < V; ++i) hi[i] = (v[i] - m) / T + noise_bound(noise_bits(base, i));
    const float reach = static_cast<float>(skip_below) - 1e-3f;  // covers hi's float roundings
    w.rivals.assign(1, {lead, key_tolerance(lead, lead_le), first});
    w.cand.clear();
    at_least(hi, V, reach, w.cand);
    for (const Cand& c : w.cand) {
      const int64_t i = c.id;
      if (i == first) continue;
      const float s = scaled(v[i]);
      if (min_p) {
        if (s < t - slack) continue;
        if (s <= t + slack) return -1;  // exp(s) too near min_p to say which side torch's floats fall
      }
      double le;
      const double key = race_key(s, noise_bits(base, i), le);
      w.rivals.push_back({key, key_tolerance(key, le), i});
    }
    return certain_winner(w.rivals);
  }
  // top_k on: the k best by penalised value are the k best by scaled value (scaling is monotone); a
  // token outside them whose scaled value rounds onto the k-th's ties with it, and top_k keeps ties.
  const int64_t k = r.top_k;
  top_k1(v, V, k, w.heap, w.maxima);
  const float kth = scaled(w.heap[k - 1].value);
  w.cand.clear();
  if (scaled(w.heap[k].value) >= kth) {
    for (int64_t i = 0; i < V; ++i)
      if (scaled(v[i]) >= kth) w.cand.push_back({scaled(v[i]), i});
  } else {
    for (int64_t i = 0; i < k; ++i) w.cand.push_back({scaled(w.heap[i].value), w.heap[i].id});
  }
  std::sort(w.cand.begin(), w.cand.end(), ranks_before);  // the stable descending sort of the scaled values
  const size_t n = w.cand.size();
  std::vector<double>& e = w.e;
  std::vector<char>& keep = w.keep;
  e.resize(n);
  keep.assign(n, 1);
  if (top_p || min_p) {
    double sum = 0;
    for (size_t j = 0; j < n; ++j) sum += e[j] = std::exp(static_cast<double>(w.cand[j].value));
    // torch's probabilities: exp to kExpErr each, a float sum of n terms in some order, a reciprocal, a
    // product; its cumulative sum accumulates in double (float would add n more roundings: allowed too).
    const double rel = 2 * kExpErr + (2 * n + 8) * kUlp / 2;
    double before = 0;
    for (size_t j = 1; j < n; ++j) {
      before += e[j - 1] / sum;
      if (top_p) {
        const double p = r.top_p, tol = rel * std::max(before, p) + 0x1p-100;
        if (std::fabs(before - p) <= tol) return -1;
        keep[j] = before < p;
      }
      if (min_p && keep[j]) {  // p_j >= min_p p_0, p_0 = exp(0) / sum: exp(s_j) against min_p
        const double q = r.min_p, tol = (2 * kExpErr + 8 * kUlp) * std::max(e[j], q) + 0x1p-100;
        if (std::fabs(e[j] - q) <= tol) return -1;
        keep[j] = e[j] >= q;
      }
    }
  }
  return race_kept(w, base);
}

}  // namespace

// x (B, V) fp32 logits; rows (B, 6) fp32: temperature, top_p, min_p, repetition penalty, presence,
// frequency; top_k (B,) int64: 0 for a greedy row, V when off; seen (B, V) bool and counts (B, V) fp32,
// or empty tensors when no row uses them; keys, draws (B,): each row's RowStream (noise.py) at this draw;
// lanes: the fp32 lane count of torch's own vectorised kernels (16 AVX512, 8 AVX2, 0 otherwise).
// Returns (tokens (B,) int64, deferred): when deferred, nothing was written and the tokens mean nothing;
// else seen and counts hold the tokens, as Sampler.__call__ leaves them.
std::tuple<torch::Tensor, bool> draw(torch::Tensor x, torch::Tensor rows, torch::Tensor top_k, torch::Tensor seen,
                                     torch::Tensor counts, std::vector<uint64_t> keys,
                                     std::vector<int64_t> draws, int64_t lanes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu() && x.is_contiguous(),
              "draw: x must be a contiguous (B, V) fp32 CPU tensor");
  const int64_t B = x.size(0), V = x.size(1);
  TORCH_CHECK(rows.sizes() == torch::IntArrayRef({B, 6}) && rows.scalar_type() == torch::kFloat32 && rows.is_contiguous(),
              "draw: rows must be (B, 6) fp32");
  TORCH_CHECK(top_k.sizes() == torch::IntArrayRef({B}) && top_k.scalar_type() == torch::kLong, "draw: top_k (B,) int64");
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == B && static_cast<int64_t>(draws.size()) == B && V > 0,
              "draw: one stream a row, rows of at least one value");
  const bool use_seen = seen.numel() > 0, use_counts = counts.numel() > 0;
  TORCH_CHECK(!use_seen || (seen.sizes() == x.sizes() && seen.scalar_type() == torch::kBool && seen.is_contiguous()),
              "draw: seen (B, V) bool");
  TORCH_CHECK(!use_counts || (counts.sizes() == x.sizes() && counts.scalar_type() == torch::kFloat32 &&
                              counts.is_contiguous()), "draw: counts (B, V) fp32");
  auto tokens = torch::empty({B}, torch::kInt64);
  int64_t* tp = tokens.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  const float* rp = rows.data_ptr<float>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  bool* sp = use_seen ? seen.data_ptr<bool>() : nullptr;
  float* cp = use_counts ? counts.data_ptr<float>() : nullptr;
  std::vector<char> deferred(B, 0);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    Scratch& w = thread_scratch();
    for (int64_t b = begin; b < end; ++b) {
      const Row r{rp[b * 6], rp[b * 6 + 1], rp[b * 6 + 2], rp[b * 6 + 3], rp[b * 6 + 4], rp[b * 6 + 5], kp[b]};
      const float* v = xp + b * V;
      float m;
      bool finite;
      int64_t first;
      scan_max(v, V, m, finite, first);
      if (!finite) {  // NONFINITE: the torch path decides what its state records
        deferred[b] = 1;
        continue;
      }
      if (use_seen || use_counts) {  // sampling.penalize_seen, then _penalize_counts, op by op
        w.pen.resize(V);
        const uint8_t* s = use_seen ? reinterpret_cast<const uint8_t*>(sp + b * V) : nullptr;  // bool: no vectors
        const float* c = use_counts ? cp + b * V : nullptr;
        float* out = w.pen.data();
        // Two loops without branches, so each vectorises; torch evaluates every branch of its where()s too.
        if (s) {
          for (int64_t i = 0; i < V; ++i) {
            const float y = v[i], down = y < 0 ? y * r.penalty : y / r.penalty;
            out[i] = s[i] != 0 ? down : y;
          }
        } else {
          std::copy(v, v + V, out);
        }
        if (c)
          for (int64_t i = 0; i < V; ++i) out[i] = out[i] - r.presence * (c[i] > 0 ? 1.f : 0.f) - r.frequency * c[i];
        v = w.pen.data();
        scan_max(v, V, m, finite, first);
        if (!finite) {  // a penalty pushed a finite logit to inf
          deferred[b] = 1;
          continue;
        }
      }
      const uint64_t base = mix(keys[b] + (static_cast<uint64_t>(draws[b]) + 1) * kGolden);  // RowStream.base(RACE)
      tp[b] = r.top_k == 0 ? first : race_row(v, V, m, first, r, base, static_cast<int>(lanes), w);
      deferred[b] = tp[b] < 0;
    }
  });
  for (int64_t b = 0; b < B; ++b)
    if (deferred[b]) return {tokens, true};
  for (int64_t b = 0; b < B; ++b) {
    if (use_seen) sp[b * V + tp[b]] = true;
    if (use_counts) cp[b * V + tp[b]] += 1.f;
  }
  return {tokens, false};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("draw", &draw, "one step of the batch sampler, or deferred to the torch path");
  m.def("top_p_rows", [] { return std::make_tuple(sluice_top_p::bounded.load(), sluice_top_p::sorted.load(),
                                                   sluice_top_p::moving.load()); },
        "rows whose top_p cut was proven without a sort, rows that were sorted, and rows drawn from a cut proven "
        "to within a few tokens (since load)");
  m.def("has_avx2", &has_avx2);
  m.def("has_avx512", &has_avx512);
}
