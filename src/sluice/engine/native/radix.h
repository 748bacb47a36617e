// A stable sort of fp32 values into descending order, as torch.sort(descending=True, stable=True) orders them
// (select.cpp's sort_descending, and sample.cpp's exact top_p, which sorts the part of a row its softmax
// sum depends on). Why a radix sort: ATen's stable sort took ~0.4 ms a row of 8,192; this is three counting
// passes. Each float maps to a 32-bit key whose ascending order is the values' descending order; counting
// passes are stable, so equal keys keep their input order (ids ascending, when the input is in id order).
// The key follows torch's comparisons, not the raw bits: -0.0 and +0.0 are equal, and every NaN (whatever
// its sign) ranks above +inf.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace sluice_radix {

inline uint32_t descending_key(float f) {
  if (std::isnan(f)) return 0;
  if (f == 0.0f) f = 0.0f;  // -0.0 -> +0.0
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint32_t ascending = (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
  return ~ascending;
}

constexpr int kDigitBits = 11, kDigits = 3, kBuckets = 1 << kDigitBits;  // 3 x 11 bits cover the 32

// Sorts the n pairs (key[i], idx[i]) by key ascending, stably; returns the array that holds the sorted ids
// (idx or idx2: the passes swap buffers). key2 and idx2 are scratch of n entries each; key is clobbered.
inline uint32_t* sort_keys(uint32_t* key, uint32_t* idx, uint32_t* key2, uint32_t* idx2, int64_t n) {
  std::vector<uint32_t> count(kDigits * kBuckets, 0);
  for (int64_t i = 0; i < n; ++i)
    for (int d = 0; d < kDigits; ++d) ++count[d * kBuckets + ((key[i] >> (d * kDigitBits)) & (kBuckets - 1))];
  for (int d = 0; d < kDigits && n > 0; ++d) {
    uint32_t* c = count.data() + d * kBuckets;
    const int shift = d * kDigitBits;
    if (c[(key[0] >> shift) & (kBuckets - 1)] == static_cast<uint32_t>(n)) continue;  // one bucket: order kept
    uint32_t sum = 0;
    for (int b = 0; b < kBuckets; ++b) {
      const uint32_t m = c[b];
      c[b] = sum;
      sum += m;
    }
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t at = c[(key[i] >> shift) & (kBuckets - 1)]++;
      key2[at] = key[i];
      idx2[at] = idx[i];
    }
    std::swap(key, key2);
    std::swap(idx, idx2);
  }
  return idx;
}

// ids[0:n] (distinct, ascending) -> the same ids ordered by p[id] descending, ties by id: a stable descending
// sort of the values they name. scratch is resized to 4n.
inline void sort_ids_descending(const float* p, uint32_t* ids, int64_t n, std::vector<uint32_t>& scratch) {
  scratch.resize(4 * static_cast<size_t>(n));
  uint32_t *key = scratch.data(), *idx = key + n, *key2 = idx + n, *idx2 = key2 + n;
  for (int64_t i = 0; i < n; ++i) {
    key[i] = descending_key(p[ids[i]]);
    idx[i] = ids[i];
  }
  const uint32_t* sorted = sort_keys(key, idx, key2, idx2, n);
  std::memcpy(ids, sorted, n * sizeof(uint32_t));
}

// The same order for a few ids (n up to ~64) by insertion: the radix passes' 3 x 2,048 counters cost more
// than sorting a few dozen (top_p_cut.h's bracket). Insertion is stable, as the counting passes are, and
// compares the same keys, so both give the same order.
inline void sort_few_ids_descending(const float* p, uint32_t* ids, int64_t n) {
  for (int64_t i = 1; i < n; ++i) {
    const uint32_t id = ids[i], key = descending_key(p[id]);
    int64_t j = i;
    for (; j > 0 && descending_key(p[ids[j - 1]]) > key; --j) ids[j] = ids[j - 1];
    ids[j] = id;
  }
}

}  // namespace sluice_radix
