// Speculative decoding's acceptance rule for a batch in one call (engine/accept.py wraps it; the torch
// version, speculative.accept, is the reference it must equal, token for token).
//
// Why: the rule is ~25 small torch ops over (B, K + 1, V) a round (gathers, a cumulative product, the
// residual max(0, p - q), a log, the counter noise, an argmax), about as long as the bundled model's
// verify forward. Here it is a few scans of the rows it reads. Exactness: everything up to the final
// draw is float multiplies, subtractions and comparisons, done op by op as torch does them, so the same
// bits. The final draw races log(d) - log(-log u) over the chosen distribution d: its logs are computed
// in double with a bound on how far torch's float keys can be, and the winner is taken only where the
// bound proves torch picks it (as sample.cpp does); else, and on a NaN anywhere the rule reads, the call
// changes nothing and says "defer", and the caller runs the torch rule.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.h"
#include "spec_rows.h"

// torch rounds u * q(x) before comparing it with p(x); a fused multiply-add here would not.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kAccept = 0x5BD1E9955BD1E995ull;  // noise.ACCEPT, the acceptance uniforms' domain
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

// The first index of d's largest value (torch.argmax on a NaN-free row).
int64_t first_max(const float* d, int64_t V) {
  int64_t best = 0;
  for (int64_t i = 1; i < V; ++i)
    if (d[i] > d[best]) best = i;
  return best;
}

struct Rival {
  double key, tol;
  int64_t id;
};

// The race's winner over d (NaN-free, some d_i > 0) with noise base `base`, or -1 when torch's float keys
// could rank two contenders either way. A token with d_i = 0 has key -inf and never wins. The noise term
// -log(-log u) is at most -log(1 - u), so a token's key is at most log(d_i / (1 - u_i)): one that cannot
// reach the leader's key by that bound is passed over on a product and a compare, without a log (an
// unfiltered draft row races all 8,192 tokens: two logs each cost ~0.2 ms a draw).
int64_t race(const float* d, int64_t V, uint64_t base, std::vector<Rival>& rivals) {
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

bool any_nan(const float* p, int64_t V) {
  bool bad = false;
  for (int64_t i = 0; i < V; ++i) bad |= std::isnan(p[i]);
  return bad;
}

}  // namespace

// speculative.accept for a batch: p (B, K+1, V) and q (B, K, V) fp32 (q empty: a point mass on each
// guess), draft (B, K) and lengths (B,) int64, sampled (B,) bool (the other rows decide by argmax), keys
// and draws (B,): each row's RowStream at the acceptance draw (the final draw is the next one). Returns
// (n (B,) guesses kept, final (B,) the token after them, deferred); when deferred nothing means anything.
// With logits (B, K+1, V) given instead of p (p empty), each row's p at a position is computed when the rule
// first reads it (nucleus_row with the row's temperature and top_p; a one-hot argmax on a greedy row): a
// round that rejects its first guess filters one position, not K+1.
std::tuple<torch::Tensor, torch::Tensor, bool> accept_rule(torch::Tensor p, torch::Tensor q, torch::Tensor draft,
                                                           torch::Tensor lengths, torch::Tensor sampled,
                                                           std::vector<uint64_t> keys, std::vector<int64_t> draws,
                                                           torch::Tensor logits, torch::Tensor temperature,
                                                           torch::Tensor top_p, int64_t W) {
  const bool lazy = logits.numel() > 0;
  const torch::Tensor& src = lazy ? logits : p;
  TORCH_CHECK(src.dim() == 3 && src.scalar_type() == torch::kFloat32 && src.is_contiguous() && src.device().is_cpu(),
              "accept: p (or logits) must be a contiguous (B, K+1, V) fp32 CPU tensor");
  const int64_t B = src.size(0), K = src.size(1) - 1, V = src.size(2);
  const bool point = q.numel() == 0;
  TORCH_CHECK(K >= 0 && V > 0, "accept: p must have K+1 >= 1 positions of V >= 1 values");
  TORCH_CHECK(point || (q.sizes() == torch::IntArrayRef({B, K, V}) && q.scalar_type() == torch::kFloat32 &&
                        q.is_contiguous()), "accept: q must be (B, K, V) fp32 or empty");
  TORCH_CHECK(draft.sizes() == torch::IntArrayRef({B, K}) && draft.scalar_type() == torch::kLong &&
              draft.is_contiguous(), "accept: draft (B, K) int64");
  TORCH_CHECK(lengths.sizes() == torch::IntArrayRef({B}) && lengths.scalar_type() == torch::kLong &&
              sampled.sizes() == torch::IntArrayRef({B}) && sampled.scalar_type() == torch::kBool,
              "accept: lengths (B,) int64, sampled (B,) bool");
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == B && static_cast<int64_t>(draws.size()) == B,
              "accept: one stream a row");
  TORCH_CHECK(!lazy || (temperature.sizes() == torch::IntArrayRef({B}) && top_p.sizes() == torch::IntArrayRef({B}) &&
                        temperature.scalar_type() == torch::kFloat32 && top_p.scalar_type() == torch::kFloat32 &&
                        (W == 8 || W == 16)), "accept: temperature and top_p (B,) fp32, W 8 or 16");
  auto n_out = torch::empty({B}, torch::kInt64), final_out = torch::empty({B}, torch::kInt64);
  int64_t *np = n_out.data_ptr<int64_t>(), *fp = final_out.data_ptr<int64_t>();
  const float* pp = src.data_ptr<float>();
  const float* qp = point ? nullptr : q.data_ptr<float>();
  const float *tp = lazy ? temperature.data_ptr<float>() : nullptr, *topp = lazy ? top_p.data_ptr<float>() : nullptr;
  const int64_t *dp = draft.data_ptr<int64_t>(), *lp = lengths.data_ptr<int64_t>();
  const bool* sp = sampled.data_ptr<bool>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(0 <= lp[b] && lp[b] <= K, "accept: lengths must be in [0, K]");
  std::vector<char> deferred(B, 0);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> residual(V), row(lazy ? V : 0);
    std::vector<Rival> rivals;
    sluice_spec::Nucleus scratch;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = lp[b];
      const uint64_t accept_base = base_of(keys[b], kAccept, draws[b]);
      auto p_at = [&](int64_t j) -> const float* {  // the row's p at position j, or nullptr to defer
        const float* at = pp + (b * (K + 1) + j) * V;
        if (!lazy) return at;
        if (sp[b]) return sluice_spec::nucleus_row(at, V, tp[b], topp[b], static_cast<int>(W), row.data(), scratch) ? row.data() : nullptr;
        // a non-finite logit defers (the torch path ends the run there): what this call decides read finite rows
        if (!std::all_of(at, at + V, [](float v) { return std::isfinite(v); })) return nullptr;
        std::fill(row.begin(), row.end(), 0.f);
        row[first_max(at, V)] = 1.f;
        return row.data();
      };
      // The leading run of kept guesses: u q(x) < p(x), u = 0 on a greedy row (kept iff p(x) > 0).
      int64_t n = 0;
      bool bad = false;
      const float* target = nullptr;
      for (;; ++n) {
        target = p_at(n);
        if (target == nullptr || n == len) break;
        const int64_t x = dp[b * K + n];
        const float px = target[x], qx = point ? 1.f : qp[(b * K + n) * V + x];
        const float u = sp[b] ? static_cast<float>(bits_of(accept_base, n)) * 0x1p-24f : 0.f;
        bad |= std::isnan(px) || std::isnan(qx);
        if (!(u * qx < px)) break;
      }
      bad |= target == nullptr || any_nan(target, V);
      const float* d = target;
      if (!bad && n < len) {  // rejected: max(0, p - q) at the first rejected guess; p without the guess for a point mass
        float* r = residual.data();
        if (point) {
          std::copy(target, target + V, r);
          r[dp[b * K + n]] = 0.f;
        } else {
          const float* qn = qp + (b * K + n) * V;
          bad |= any_nan(qn, V);
          for (int64_t i = 0; i < V; ++i) r[i] = std::max(target[i] - qn[i], 0.f);
        }
        // p == q in exact arithmetic never rejects; rounding can, with a residual of zeros: then p itself.
        if (std::any_of(r, r + V, [](float v) { return v > 0; })) d = r;
      }
      if (bad) {
        deferred[b] = 1;
        continue;
      }
      np[b] = n;
      fp[b] = sp[b] ? race(d, V, base_of(keys[b], 0, draws[b] + 1), rivals) : first_max(d, V);
      deferred[b] = fp[b] < 0;
    }
  });
  const bool any_deferred = std::any_of(deferred.begin(), deferred.end(), [](char c) { return c != 0; });
  return {n_out, final_out, any_deferred};
}

// nucleus_row for each row of x (N, V) fp32, a one-hot first argmax where temperature is 0: the bits of
// RoundProbs for rows of temperature and top_p alone. Returns (probs, deferred).
std::tuple<torch::Tensor, bool> nucleus_probs(torch::Tensor x, torch::Tensor temperature, torch::Tensor top_p, int64_t W) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu() &&
              x.size(1) > 0, "nucleus_probs: x must be a contiguous (N, V) fp32 CPU tensor");
  const int64_t N = x.size(0), V = x.size(1);
  TORCH_CHECK(temperature.sizes() == torch::IntArrayRef({N}) && top_p.sizes() == torch::IntArrayRef({N}) &&
              temperature.scalar_type() == torch::kFloat32 && top_p.scalar_type() == torch::kFloat32 &&
              (W == 8 || W == 16), "nucleus_probs: temperature and top_p (N,) fp32, W 8 or 16");
  auto out = torch::zeros({N, V}, torch::kFloat32);
  const float *xp = x.data_ptr<float>(), *tp = temperature.data_ptr<float>(), *pp = top_p.data_ptr<float>();
  float* op = out.data_ptr<float>();
  sluice_spec::Nucleus scratch;
  bool deferred = false;
  for (int64_t i = 0; i < N && !deferred; ++i) {
    if (tp[i] > 0) {
      deferred = !sluice_spec::nucleus_row(xp + i * V, V, tp[i], pp[i], static_cast<int>(W), op + i * V, scratch);
    } else {
      deferred = any_nan(xp + i * V, V);
      op[i * V + first_max(xp + i * V, V)] = 1.f;
    }
  }
  return {out, deferred};
}

std::tuple<torch::Tensor, torch::Tensor, bool> accept(torch::Tensor p, torch::Tensor q, torch::Tensor draft,
                                                      torch::Tensor lengths, torch::Tensor sampled,
                                                      std::vector<uint64_t> keys, std::vector<int64_t> draws) {
  const torch::Tensor none;
  return accept_rule(p, q, draft, lengths, sampled, keys, draws, torch::empty({0}), none, none, 0);
}

// speculative.draw for a batch: one token per row of probs (B, V) fp32, the race over log p on a sampled
// row (its stream at keys[b], draws[b]), the first argmax on another. Returns (tokens (B,), deferred).
std::tuple<torch::Tensor, bool> draw(torch::Tensor probs, torch::Tensor sampled, std::vector<uint64_t> keys,
                                     std::vector<int64_t> draws) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == torch::kFloat32 && probs.is_contiguous() &&
              probs.device().is_cpu() && probs.size(1) > 0, "draw: probs must be a contiguous (B, V) fp32 CPU tensor");
  const int64_t B = probs.size(0), V = probs.size(1);
  TORCH_CHECK(sampled.sizes() == torch::IntArrayRef({B}) && sampled.scalar_type() == torch::kBool &&
              static_cast<int64_t>(keys.size()) == B && static_cast<int64_t>(draws.size()) == B,
              "draw: sampled (B,) bool and one stream a row");
  auto tokens = torch::empty({B}, torch::kInt64);
  int64_t* tp = tokens.data_ptr<int64_t>();
  const float* pp = probs.data_ptr<float>();
  const bool* sp = sampled.data_ptr<bool>();
  std::vector<Rival> rivals;
  bool deferred = false;
  for (int64_t b = 0; b < B && !deferred; ++b) {
    const float* d = pp + b * V;
    deferred = any_nan(d, V);
    tp[b] = deferred ? -1 : sp[b] ? race(d, V, base_of(keys[b], 0, draws[b]), rivals) : first_max(d, V);
    deferred = tp[b] < 0;
  }
  return {tokens, deferred};
}

// One draft guess for a batch: nucleus_probs of x (B, V) with top_p off, then draw over them, in one call
// (proposers.py made them two calls a guess). sampled (B,): the rows that race (the others take the first
// argmax of their row of q, as draw's unlisted rows do). Returns (q (B, V), tokens (B,), deferred); on
// deferred nothing means anything, and the caller runs the two calls. A non-finite logit anywhere defers,
// so a guess drawn here comes from finite logits.
std::tuple<torch::Tensor, torch::Tensor, bool> propose(torch::Tensor x, torch::Tensor temperature, torch::Tensor sampled,
                                                       std::vector<uint64_t> keys, std::vector<int64_t> draws, int64_t W) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu() &&
              x.size(1) > 0, "propose: x must be a contiguous (B, V) fp32 CPU tensor");
  const int64_t B = x.size(0), V = x.size(1);
  TORCH_CHECK(temperature.sizes() == torch::IntArrayRef({B}) && temperature.scalar_type() == torch::kFloat32 &&
              sampled.sizes() == torch::IntArrayRef({B}) && sampled.scalar_type() == torch::kBool &&
              static_cast<int64_t>(keys.size()) == B && static_cast<int64_t>(draws.size()) == B && (W == 8 || W == 16),
              "propose: temperature (B,) fp32, sampled (B,) bool, one stream a row, W 8 or 16");
  auto q = torch::zeros({B, V}, torch::kFloat32);
  auto tokens = torch::empty({B}, torch::kInt64);
  const float *xp = x.data_ptr<float>(), *tp = temperature.data_ptr<float>();
  const bool* sp = sampled.data_ptr<bool>();
  float* qp = q.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  sluice_spec::Nucleus scratch;
  std::vector<Rival> rivals;
  bool deferred = false;
  for (int64_t b = 0; b < B && !deferred; ++b) {
    const float *row = xp + b * V;
    float* d = qp + b * V;
    if (tp[b] > 0) {
      deferred = !sluice_spec::nucleus_row(row, V, tp[b], 1.f, static_cast<int>(W), d, scratch) || any_nan(d, V);
    } else {
      deferred = !std::all_of(row, row + V, [](float v) { return std::isfinite(v); });  // (a sampled row's too)
      if (!deferred) d[first_max(row, V)] = 1.f;
    }
    if (deferred) break;
    out[b] = sp[b] ? race(d, V, base_of(keys[b], 0, draws[b]), rivals) : first_max(d, V);
    deferred = out[b] < 0;
  }
  return {q, tokens, deferred};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("propose", &propose, "a draft guess for a batch: its probabilities and its draw, or deferred");
  m.def("top_p_rows", [] { return std::make_tuple(sluice_top_p::bounded.load(), sluice_top_p::sorted.load()); },
        "rows cut by the bounded top_p cut, and rows sorted");
  m.def("draw", &draw, "speculative decoding's race over probabilities for a batch, or deferred to torch");
  m.def("accept", &accept, "speculative decoding's acceptance rule for a batch, or deferred to the torch rule");
  m.def("accept_logits", &accept_rule, "the acceptance rule with p filtered from logits where it reads it");
  m.def("nucleus_probs", &nucleus_probs, "RoundProbs' probabilities of rows with temperature and top_p alone");
  m.def("has_avx2", &has_avx2);
  m.def("has_avx512", &has_avx512);
}
