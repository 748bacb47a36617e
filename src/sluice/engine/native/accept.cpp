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
#include "draw.h"

// torch rounds u * q(x) before comparing it with p(x); a fused multiply-add here would not.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

using namespace sluice_draw;

constexpr uint64_t kAccept = 0x5BD1E9955BD1E995ull;  // noise.ACCEPT, the acceptance uniforms' domain

// One row of a round, as the rule reads it: x its K_b + 1 positions (V values each) of p or (lazy) logits; q its
// draft's K_b rows (nullptr: a point mass on each guess); guess its K_b guesses; a sampled row's temperature, top_p
// (lazy only) and RowStream at the acceptance draw (the final draw is the next one).
struct RowIn {
  const float* x;
  const float* q;
  const int64_t* guess;
  int64_t len;
  bool sampled;
  float T, top_p;
  uint64_t key;
  int64_t draw;
};

struct Scratch {  // one thread's
  std::vector<float> residual, row, alt;
  std::vector<Rival> rivals;
  sluice_spec::Nucleus nucleus;
};

// speculative.accept's decision on one row: (n guesses kept, the token after them), the token -1 to defer (nothing
// decided then). lazy: x holds logits, and each p a position is computed when the rule first reads it (nucleus_row
// with the row's temperature and top_p; a one-hot argmax on a greedy row): a round that rejects its first guess
// filters one position, not K+1. Where a position's top_p cut is proven only to within a few tokens, its guess's
// decision and the final draw are taken under each of those cuts, and the row is cut exactly (nucleus_row's
// sort) only where they differ.
std::pair<int64_t, int64_t> decide(const RowIn& in, int64_t V, bool lazy, int W, Scratch& s) {
  const int64_t len = in.len;
  const bool point = in.q == nullptr;
  const uint64_t accept_base = base_of(in.key, kAccept, in.draw);
  s.residual.resize(V);
  if (lazy) s.row.resize(V), s.alt.resize(V);
  sluice_spec::Nucleus& scratch = s.nucleus;
  // The row's p at position j into `row`, or nullptr to defer. moving: a sampled row's cut may be proven only to
  // within a few tokens (scratch.uncertain > 0 then; 0 otherwise): every decision below is taken for each cut it
  // allows (nucleus_variant), and where they differ the row is cut exactly (the sort) instead.
  auto p_at = [&](int64_t j, bool moving) -> const float* {
    scratch.uncertain = 0;
    const float* at = in.x + j * V;
    if (!lazy) return at;
    if (in.sampled)
      return sluice_spec::nucleus_row(at, V, in.T, in.top_p, W, s.row.data(), scratch, moving) ? s.row.data() : nullptr;
    // a non-finite logit defers (the torch path ends the run there): what this call decides read finite rows
    const int64_t top = sluice_rows::finite_first_max(at, V);
    if (top < 0) return nullptr;
    std::fill(s.row.begin(), s.row.end(), 0.f);
    s.row[top] = 1.f;
    return s.row.data();
  };
  // The token after n kept guesses from the target row t: the race over max(0, p - q) at the first rejected guess
  // (p without the guess for a point mass), over p itself after all len; the first max on a greedy row. -1: defer
  // (a NaN the rule reads, or a race the bound cannot settle).
  auto final_of = [&](const float* t, int64_t n) -> int64_t {
    if (has_nan(t, V)) return -1;
    const float* d = t;
    if (n < len) {
      float* r = s.residual.data();
      if (point) {
        std::copy(t, t + V, r);
        r[in.guess[n]] = 0.f;
      } else {
        const float* qn = in.q + n * V;
        if (has_nan(qn, V)) return -1;
        for (int64_t i = 0; i < V; ++i) r[i] = std::max(t[i] - qn[i], 0.f);
      }
      // p == q in exact arithmetic never rejects; rounding can, with a residual of zeros: then p itself.
      if (std::any_of(r, r + V, [](float v) { return v > 0; })) d = r;
    }
    const int64_t tok = in.sampled ? race(d, V, base_of(in.key, 0, in.draw + 1), s.rivals) : first_max(d, V);
    return tok < 0 ? -1 : tok;
  };
  // The leading run of kept guesses: u q(x) < p(x), u = 0 on a greedy row (kept iff p(x) > 0).
  int64_t n = 0;
  bool bad = false;
  const float* target = nullptr;
  for (;; ++n) {
    target = p_at(n, true);
    if (target == nullptr || n == len) break;
    const int64_t x = in.guess[n];
    const float qx = point ? 1.f : in.q[n * V + x];
    const float u = in.sampled ? static_cast<float>(bits_of(accept_base, n)) * 0x1p-24f : 0.f;
    bool keep = u * qx < target[x];
    bad |= std::isnan(target[x]) || std::isnan(qx);
    for (int64_t drop = 1; drop <= scratch.uncertain && !bad; ++drop) {
      sluice_spec::nucleus_variant(V, W, drop, s.alt.data(), scratch);
      bad |= std::isnan(s.alt[x]);
      if ((u * qx < s.alt[x]) != keep) {  // the cuts disagree on this guess: cut exactly
        target = p_at(n, false);
        if (target == nullptr) break;
        keep = u * qx < target[x];
        bad |= std::isnan(target[x]);
        break;
      }
    }
    if (target == nullptr || !keep || bad) break;
  }
  int64_t tok = bad || target == nullptr ? -1 : final_of(target, n);
  for (int64_t drop = 1; tok >= 0 && drop <= scratch.uncertain; ++drop) {
    sluice_spec::nucleus_variant(V, W, drop, s.alt.data(), scratch);
    if (final_of(s.alt.data(), n) != tok) {  // the cuts draw differently: cut exactly
      target = p_at(n, false);
      tok = target == nullptr ? -1 : final_of(target, n);
      break;
    }
  }
  return {n, tok};
}

// decide() for each row, in parallel over rows; deferred: some row said defer (then nothing means anything).
bool decide_rows(const std::vector<RowIn>& rows, int64_t V, bool lazy, int W, int64_t* np, int64_t* fp) {
  const int64_t B = static_cast<int64_t>(rows.size());
  std::vector<char> deferred(B, 0);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch s;  // kept across calls: its rows are V floats each, allocated and zeroed once
    for (int64_t b = begin; b < end; ++b) {
      const auto [n, tok] = decide(rows[b], V, lazy, W, s);
      np[b] = n;
      fp[b] = tok;
      deferred[b] = tok < 0;
    }
  });
  return std::any_of(deferred.begin(), deferred.end(), [](char c) { return c != 0; });
}

// speculative.accept for a batch: p (B, K+1, V) and q (B, K, V) fp32 (q empty: a point mass on each
// guess), draft (B, K) and lengths (B,) int64, sampled (B,) bool (the other rows decide by argmax), keys
// and draws (B,): each row's RowStream at the acceptance draw (the final draw is the next one). Returns
// (n (B,) guesses kept, final (B,) the token after them, deferred); when deferred nothing means anything.
std::tuple<torch::Tensor, torch::Tensor, bool> accept(torch::Tensor p, torch::Tensor q, torch::Tensor draft,
                                                      torch::Tensor lengths, torch::Tensor sampled,
                                                      std::vector<uint64_t> keys, std::vector<int64_t> draws) {
  TORCH_CHECK(p.dim() == 3 && p.scalar_type() == torch::kFloat32 && p.is_contiguous() && p.device().is_cpu(),
              "accept: p must be a contiguous (B, K+1, V) fp32 CPU tensor");
  const int64_t B = p.size(0), K = p.size(1) - 1, V = p.size(2);
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
  const int64_t* lp = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(0 <= lp[b] && lp[b] <= K, "accept: lengths must be in [0, K]");
  const float* pp = p.data_ptr<float>();
  const float* qp = point ? nullptr : q.data_ptr<float>();
  const bool* sp = sampled.data_ptr<bool>();
  std::vector<RowIn> rows(B);
  for (int64_t b = 0; b < B; ++b)
    rows[b] = RowIn{pp + b * (K + 1) * V, point ? nullptr : qp + b * K * V, draft.data_ptr<int64_t>() + b * K, lp[b],
                    sp[b], 0.f, 1.f, keys[b], draws[b]};
  auto n_out = torch::empty({B}, torch::kInt64), final_out = torch::empty({B}, torch::kInt64);
  // (W: read only where logits are filtered)
  const bool deferred = decide_rows(rows, V, false, 0, n_out.data_ptr<int64_t>(), final_out.data_ptr<int64_t>());
  return {n_out, final_out, deferred};
}

// verify()'s round as lists, the lazy rule without the batch's padded tensors: logits[b] (len_b + 1, V) fp32 of row
// b, guesses[b] its len_b guesses, q[b] (>= len_b, V) its draft's rows (q empty: a point mass on each guess),
// sampled[b], temperature[b] (0 on a greedy row) and top_p[b], keys and draws its stream at the acceptance draw.
// Returns (n, final, deferred) as accept's, as lists.
std::tuple<std::vector<int64_t>, std::vector<int64_t>, bool> accept_rows(
    std::vector<torch::Tensor> logits, std::vector<torch::Tensor> q, std::vector<std::vector<int64_t>> guesses,
    std::vector<bool> sampled, std::vector<float> temperature, std::vector<float> top_p, std::vector<uint64_t> keys,
    std::vector<int64_t> draws, int64_t W) {
  const size_t B = logits.size();
  TORCH_CHECK(B > 0 && guesses.size() == B && sampled.size() == B && temperature.size() == B && top_p.size() == B &&
              keys.size() == B && draws.size() == B && (q.empty() || q.size() == B) && (W == 8 || W == 16),
              "accept_rows: one entry a row in every list (q: one or none), W 8 or 16");
  const int64_t V = logits[0].dim() == 2 ? logits[0].size(1) : 0;
  TORCH_CHECK(V > 0, "accept_rows: logits must be (len + 1, V) rows of V >= 1");
  std::vector<RowIn> rows(B);
  for (size_t b = 0; b < B; ++b) {
    const int64_t len = static_cast<int64_t>(guesses[b].size());
    const torch::Tensor& x = logits[b];
    TORCH_CHECK(x.dim() == 2 && x.size(0) == len + 1 && x.size(1) == V && x.scalar_type() == torch::kFloat32 &&
                x.is_contiguous() && x.device().is_cpu(),
                "accept_rows: logits[", b, "] must be a contiguous (", len + 1, ", ", V, ") fp32 CPU tensor");
    const float* qb = nullptr;
    if (!q.empty()) {
      TORCH_CHECK(q[b].dim() == 2 && q[b].size(0) >= len && q[b].size(1) == V && q[b].scalar_type() == torch::kFloat32 &&
                  q[b].is_contiguous() && q[b].device().is_cpu(),
                  "accept_rows: q[", b, "] must be a contiguous (>= ", len, ", ", V, ") fp32 CPU tensor");
      qb = q[b].data_ptr<float>();
    }
    for (const int64_t g : guesses[b]) TORCH_CHECK(0 <= g && g < V, "accept_rows: a guess outside the vocabulary");
    rows[b] = RowIn{x.data_ptr<float>(), qb, guesses[b].data(), len, static_cast<bool>(sampled[b]), temperature[b],
                    top_p[b], keys[b], draws[b]};
  }
  std::vector<int64_t> n(B), final(B);
  const bool deferred = decide_rows(rows, V, true, static_cast<int>(W), n.data(), final.data());
  return {n, final, deferred};
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
      deferred = has_nan(xp + i * V, V);
      op[i * V + first_max(xp + i * V, V)] = 1.f;
    }
  }
  return {out, deferred};
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
    deferred = has_nan(d, V);
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
    out[b] = propose_row(xp + b * V, V, tp[b], sp[b], keys[b], draws[b], static_cast<int>(W), qp + b * V, scratch, rivals);
    deferred = out[b] < 0;
  }
  return {q, tokens, deferred};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("propose", &propose, "a draft guess for a batch: its probabilities and its draw, or deferred");
  m.def("top_p_rows", [] { return std::make_tuple(sluice_top_p::bounded.load(), sluice_top_p::sorted.load(),
                                                   sluice_top_p::moving.load()); },
        "rows cut by the bounded top_p cut, rows sorted, and rows taken with a cut proven to within a few tokens");
  m.def("draw", &draw, "speculative decoding's race over probabilities for a batch, or deferred to torch");
  m.def("accept", &accept, "speculative decoding's acceptance rule for a batch, or deferred to the torch rule");
  m.def("accept_rows", &accept_rows, "the acceptance rule on a round's rows as lists, each p filtered where read");
  m.def("nucleus_probs", &nucleus_probs, "RoundProbs' probabilities of rows with temperature and top_p alone");
  m.def("has_avx2", &has_avx2);
  m.def("has_avx512", &has_avx512);
}
