// Exact per-row selections for the sampler (engine/select.py wraps them; engine/sampling.py uses them).
//
// Why: ATen's argmax over 8 rows of 8,192 logits took 70-130 us on a 2-core Xeon, and topk(41) over 4
// rows 95 us, against a native decode step of ~1 ms for all 8 rows: the sampler cost as much as the
// model. Both are a scan over the row, and a scan is a few microseconds. Nothing here does arithmetic
// on the logits: every output is a copied value or an index, so the results are exactly what the torch
// functions they replace give (select.py's fallbacks, which the tests compare them with).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "radix.h"
#include "row_max.h"
#include "simd.h"

namespace {

using sluice_rows::first_index_of;
using sluice_rows::kNegInf;
using sluice_rows::max_and_finite;

// A candidate token: ranked by value descending, then id ascending (a stable descending sort's order).
struct Cand {
  float value;
  int64_t id;
};
inline bool ranks_before(const Cand& a, const Cand& b) { return a.value > b.value || (a.value == b.value && a.id < b.id); }

}  // namespace

// x (B, V) fp32 -> (ids (B,) int64: the first index of each row's maximum, as torch.argmax gives it for a
// finite row; nonfinite (B,) bool: the row holds a NaN or an inf, and then its id means nothing).
std::tuple<torch::Tensor, torch::Tensor> argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
              "argmax_rows: a (B, V) fp32 CPU tensor");
  auto xc = x.contiguous();
  const int64_t B = xc.size(0), V = xc.size(1);
  TORCH_CHECK(V > 0, "argmax_rows: rows of at least one value");
  auto ids = torch::empty({B}, torch::kInt64);
  auto bad = torch::empty({B}, torch::kBool);
  int64_t* ip = ids.data_ptr<int64_t>();
  bool* bp = bad.data_ptr<bool>();
  for (int64_t b = 0; b < B; ++b) {
    const float* p = xc.data_ptr<float>() + b * V;
    float best;
    bool finite;
    max_and_finite(p, V, best, finite);
    ip[b] = finite ? first_index_of(p, V, best) : 0;  // the first occurrence
    bp[b] = !finite;
  }
  return {ids, bad};
}

// x (B, V) fp32, k < V -> (values (B, k), ids (B, k) int64: each row's first k entries in the order of a
// stable descending sort (value descending, then id ascending); next (B,): the (k + 1)-th largest value).
// One pass per row keeps the k + 1 best seen so far in a heap whose root is the worst of them; a later
// value enters only when it is strictly larger than the root (an equal one has a larger id, so it ranks
// after), which after the first few hundred values is rare. NaN never enters (a row with one is caught
// by argmax_rows' flag; what it gets here is still valid ids).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> top_candidates(torch::Tensor x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
              "top_candidates: a (B, V) fp32 CPU tensor");
  auto xc = x.contiguous();
  const int64_t B = xc.size(0), V = xc.size(1);
  TORCH_CHECK(0 < k && k < V, "top_candidates: k = ", k, " must be in [1, ", V, ")");
  auto values = torch::empty({B, k}, torch::kFloat32);
  auto ids = torch::empty({B, k}, torch::kInt64);
  auto next = torch::empty({B}, torch::kFloat32);
  std::vector<Cand> heap;
  heap.reserve(k + 1);
  auto worse_first = [](const Cand& a, const Cand& b) { return ranks_before(a, b); };  // max-heap of "worst"
  for (int64_t b = 0; b < B; ++b) {
    const float* p = xc.data_ptr<float>() + b * V;
    heap.clear();
    int64_t j = 0;
    for (; j < V && static_cast<int64_t>(heap.size()) < k + 1; ++j) {
      if (std::isnan(p[j])) continue;
      heap.push_back({p[j], j});
      std::push_heap(heap.begin(), heap.end(), worse_first);
    }
    auto offer = [&](int64_t i) {
      if (heap.size() < static_cast<size_t>(k + 1)) {  // only a row with NaNs gets here
        if (!std::isnan(p[i])) {
          heap.push_back({p[i], i});
          std::push_heap(heap.begin(), heap.end(), worse_first);
        }
      } else if (p[i] > heap.front().value) {
        std::pop_heap(heap.begin(), heap.end(), worse_first);
        heap.back() = {p[i], i};
        std::push_heap(heap.begin(), heap.end(), worse_first);
      }
    };
#ifdef __AVX512F__
    for (; j + 16 <= V && heap.size() == static_cast<size_t>(k + 1); j += 16) {
      __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(p + j), _mm512_set1_ps(heap.front().value), _CMP_GT_OQ);
      for (int l = 0; hit; ++l, hit >>= 1)  // in id order, re-reading the root after each entry
        if (hit & 1) offer(j + l);
    }
#endif
    for (; j < V; ++j) offer(j);
    while (heap.size() < static_cast<size_t>(k + 1)) heap.push_back({kNegInf, V});  // all-NaN rows only
    std::sort(heap.begin(), heap.end(), ranks_before);
    float* vp = values.data_ptr<float>() + b * k;
    int64_t* ip = ids.data_ptr<int64_t>() + b * k;
    for (int64_t i = 0; i < k; ++i) {
      vp[i] = heap[i].value;
      ip[i] = std::min(heap[i].id, V - 1);
    }
    next.data_ptr<float>()[b] = heap[k].value;
  }
  return {values, ids, next};
}

// x (B, V) fp32 -> (values (B, V), ids (B, V) int64): torch.sort(x, -1, descending=True, stable=True), bit
// for bit (radix.h). Why: top_p with top_k off needs the whole row in order (its softmax and cumulative sum
// run over it), and ATen's stable sort took ~0.4 ms a row of 8,192. Values are copied from x, so a -0.0
// stays -0.0.
namespace {

void sort_row(const float* p, int64_t V, float* values, int64_t* ids, std::vector<uint32_t>& scratch,
              std::vector<uint32_t>& order) {
  order.resize(V);
  for (int64_t i = 0; i < V; ++i) order[i] = static_cast<uint32_t>(i);
  sluice_radix::sort_ids_descending(p, order.data(), V, scratch);
  for (int64_t i = 0; i < V; ++i) {
    ids[i] = order[i];
    values[i] = p[order[i]];
  }
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> sort_descending(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
              "sort_descending: a (B, V) fp32 CPU tensor");
  auto xc = x.contiguous();
  const int64_t B = xc.size(0), V = xc.size(1);
  TORCH_CHECK(V < (int64_t{1} << 32), "sort_descending: rows of under 2^32 values");
  auto values = torch::empty({B, V}, torch::kFloat32);
  auto ids = torch::empty({B, V}, torch::kInt64);
  const float* xp = xc.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> scratch, order;
    for (int64_t b = begin; b < end; ++b) sort_row(xp + b * V, V, vp + b * V, ip + b * V, scratch, order);
  });
  return {values, ids};
}

// Counter-based uniforms for the samplers (engine/noise.py has the definition and the numpy reference):
// token t of a row whose draw has base b gets u = (mix(b + (t + 1) * kGolden) >> 40) * 2^-24 in [0, 1),
// where mix is splitmix64's finaliser. Integer arithmetic only, so both give the same bits.
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

inline float counter_uniform(uint64_t base, uint64_t t) {
  uint64_t z = base + (t + 1) * kGolden;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * 0x1p-24f;  // 24 bits: exact in fp32
}

// (B, L) uniforms of the tokens ids (B, L) for rows with draw bases (B,) (int64 holding uint64 bits).
torch::Tensor counter_uniforms(torch::Tensor bases, torch::Tensor ids) {
  TORCH_CHECK(bases.dim() == 1 && bases.scalar_type() == torch::kLong && ids.dim() == 2 &&
                  ids.scalar_type() == torch::kLong && ids.size(0) == bases.size(0),
              "counter_uniforms: bases (B,) and ids (B, L), int64");
  auto b = bases.contiguous(), i = ids.contiguous();
  const int64_t B = i.size(0), L = i.size(1);
  auto out = torch::empty({B, L}, torch::kFloat32);
  const int64_t *bp = b.data_ptr<int64_t>(), *ip = i.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < B; ++r)
    for (int64_t j = 0; j < L; ++j)
      o[r * L + j] = counter_uniform(static_cast<uint64_t>(bp[r]), static_cast<uint64_t>(ip[r * L + j]));
  return out;
}

// (B, n) uniforms of the tokens start..start + n - 1 of every row.
torch::Tensor counter_uniform_rows(torch::Tensor bases, int64_t start, int64_t n) {
  TORCH_CHECK(bases.dim() == 1 && bases.scalar_type() == torch::kLong && start >= 0 && n >= 0,
              "counter_uniform_rows: bases (B,) int64, start and n >= 0");
  auto b = bases.contiguous();
  const int64_t B = b.size(0);
  auto out = torch::empty({B, n}, torch::kFloat32);
  const int64_t* bp = b.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < B; ++r)
    for (int64_t j = 0; j < n; ++j)  // GCC vectorises this loop (64-bit lanes) at -O3 -march=native
      o[r * n + j] = counter_uniform(static_cast<uint64_t>(bp[r]), static_cast<uint64_t>(start + j));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("argmax_rows", &argmax_rows, "each row's first argmax and whether it holds a NaN or an inf");
  m.def("top_candidates", &top_candidates, "each row's k best in stable descending order, and the (k+1)-th value");
  m.def("sort_descending", &sort_descending, "torch.sort(x, -1, descending=True, stable=True), bit for bit");
  m.def("counter_uniforms", &counter_uniforms, "counter-based uniforms of the given tokens (engine/noise.py)");
  m.def("counter_uniform_rows", &counter_uniform_rows, "counter-based uniforms of a range of tokens (engine/noise.py)");
  m.def("has_avx2", &has_avx2);
  m.def("has_avx512", &has_avx512);
}
