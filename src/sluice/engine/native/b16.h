// step.cpp's products with bf16 weights on the AVX-512 tiles. A part of step.cpp kept apart for length: included
// inside step.cpp's namespace after Linear, Prefetch, reduce16, tile and LineAligned, and used by block().
//
// Two modes, one per Step (fast_step.py's BF16_DOT), each the same for every tile shape and chunk, so a token's
// numbers never depend on its batch or on how its prompt was cut:
// - fp32 (Linear::bdot off): the weights widened exactly, fp32 products and sums. A 512-bit load holds 32
//   weights; as 16 32-bit lanes, lane i holds w[2i] in its low half and w[2i + 1] in its high half, so
//   w[2i] = v << 16 and w[2i + 1] = v & 0xFFFF0000 widen in one uop each, with no cross-lane shuffle (the
//   16-at-a-time widening, vpmovzxwd + shift, took two uops on the FMA ports per 16 weights). The input is read
//   de-interleaved to match (B16In::xd: per 32 inputs, the 16 even ones, then the 16 odd ones; inputs past the
//   last whole 32 as they are), and lane i sums w[2i] x[2i], then w[2i + 1] x[2i + 1]. A prefill pass that first
//   widens its rows into an fp32 scratch stores them de-interleaved the same way (widen_b16_row), so tile<float>
//   over the scratch runs these very operations.
// - bf16 dot (bdot, only where the CPU has AVX512_BF16): the input rounded to bf16 (to nearest even, as
//   vcvtneps2bf16 and torch's .to(bfloat16) round) and vdpbf16ps, which adds two exact bf16 x bf16 products to
//   each fp32 lane: twice the products per instruction, what llama.cpp's bf16 path does. Within its own bound of
//   the model whose linears round x so (tests/engine/test_fast_step_bf16_dot.py).
// The input is prepared once per linear and thread (b16_input, called where the linear's input is final) and
// read by every tile of it.

#ifdef SLUICE_AVX512
#if defined(__AVX512BF16__)
#define SLUICE_BF16_DOT 1
#endif

struct B16In {
  const float* x = nullptr;  // the input it was made from (M rows of K)
  int64_t M = 0, K = 0;
  bool dot = false;
  const float* xd = nullptr;     // fp32 mode: the rows de-interleaved (see above), K apart
  const uint16_t* xb = nullptr;  // dot mode: the rows rounded to bf16, K apart
};

// This thread's prepared input for a bf16 L over x (M rows of L.k floats). fresh: make it anew (the caller's x has
// new contents); otherwise reuse the last one if it was made from the same x, shape and mode.
inline const B16In& b16_input(const Linear& L, const float* x, int64_t M, bool fresh = true) {
  static thread_local B16In in;
  static thread_local std::vector<float, LineAligned<float>> xd;
  static thread_local std::vector<uint16_t, LineAligned<uint16_t>> xb;
  const int64_t K = L.k;
  if (!fresh && in.x == x && in.M == M && in.K == K && in.dot == L.bdot) return in;
  in = B16In{x, M, K, L.bdot, nullptr, nullptr};
  const int64_t K32 = K / 32 * 32;
  if (L.bdot) {
#ifdef SLUICE_BF16_DOT
    if (static_cast<int64_t>(xb.size()) < M * K) xb.resize(M * K);
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * K;
      uint16_t* o = xb.data() + m * K;
      for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 live = first_lanes(K - k);
        const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(live, xr + k));
        _mm256_mask_storeu_epi16(o + k, live, reinterpret_cast<const __m256i&>(b));
      }
    }
    in.xb = xb.data();
#endif
    return in;
  }
  if (static_cast<int64_t>(xd.size()) < M * K) xd.resize(M * K);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    float* o = xd.data() + m * K;
    for (int64_t k = 0; k < K32; k += 32) {
      const __m512 lo = _mm512_loadu_ps(xr + k), hi = _mm512_loadu_ps(xr + k + 16);
      _mm512_storeu_ps(o + k, _mm512_permutex2var_ps(lo, even, hi));
      _mm512_storeu_ps(o + k + 16, _mm512_permutex2var_ps(lo, odd, hi));
    }
    std::copy(xr + K32, xr + K, o + K32);
  }
  in.xd = xd.data();
  return in;
}

// out[0:K] = w[0:K] widened to fp32, each whole 32 de-interleaved as B16In::xd (exact).
inline void widen_b16_row(const bf16* w, int64_t K, float* out) {
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512i v = _mm512_loadu_si512(w + k);
    _mm512_storeu_ps(out + k, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
    _mm512_storeu_ps(out + k + 16, _mm512_castsi512_ps(_mm512_and_si512(v, hi)));
  }
  for (; k < K; ++k) out[k] = widen(w[k]);
}

// tile() for bf16 weights in fp32 mode, x de-interleaved (B16In::xd): per whole 32, lane i of each sum adds
// w[2i] x[2i], then w[2i + 1] x[2i + 1]; a last 16 and the K % 16 tail as tile() (so tile<float> over
// widen_b16_row's scratch gives the same bits). Pf: lines per 16 k, as tile()'s.
template <int R, int MT, int Pf = 0>
inline __m512 tile_b16(const bf16* const w[R], const float* x, int64_t ldx, int64_t K, Prefetch& pf) {
  static_assert(R * MT <= 16, "one reduce16 per tile");
  const char *pp = pf.p, *const pend = pf.end;
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    prefetch_step<Pf>(pp, pend, pf.far, pf.per_step);
    prefetch_step<Pf>(pp, pend, pf.far, pf.per_step);
    __m512 xe[MT], xo[MT];
    for (int m = 0; m < MT; ++m) xe[m] = _mm512_loadu_ps(x + m * ldx + k), xo[m] = _mm512_loadu_ps(x + m * ldx + k + 16);
    for (int r = 0; r < R; ++r) {
      const __m512i v = _mm512_loadu_si512(w[r] + k);
      const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), wo = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
      for (int m = 0; m < MT; ++m) a[m * R + r] = _mm512_fmadd_ps(we, xe[m], a[m * R + r]);
      for (int m = 0; m < MT; ++m) a[m * R + r] = _mm512_fmadd_ps(wo, xo[m], a[m * R + r]);
    }
  }
  if (k + 16 <= K) {
    prefetch_step<Pf>(pp, pend, pf.far, pf.per_step);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = load16(w[r] + k);
      for (int m = 0; m < MT; ++m) a[m * R + r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * ldx + k), a[m * R + r]);
    }
    k += 16;
  }
  pf.p = pp;
  return reduce_tail<bf16, R, MT>(a, w, x, ldx, k, K);
}

#ifdef SLUICE_BF16_DOT
// The dot mode's tile: x rounded to bf16 (B16In::xb); per 32 k one vdpbf16ps per sum, the K % 32 tail as one
// more over zero-filled lanes. Pf: lines per 16 k, as tile()'s.
template <int R, int MT, int Pf = 0>
inline __m512 tile_dp(const bf16* const w[R], const uint16_t* x, int64_t ldx, int64_t K, Prefetch& pf) {
  static_assert(R * MT <= 16, "one reduce16 per tile");
  const char *pp = pf.p, *const pend = pf.end;
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    prefetch_step<Pf>(pp, pend, pf.far, pf.per_step);
    prefetch_step<Pf>(pp, pend, pf.far, pf.per_step);
    __m512bh xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * ldx + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w[r] + k);
      for (int m = 0; m < MT; ++m) a[m * R + r] = _mm512_dpbf16_ps(a[m * R + r], xv[m], wv);
    }
  }
  if (k < K) {
    const __mmask32 live = static_cast<__mmask32>((uint64_t{1} << (K - k)) - 1);
    __m512bh xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(live, x + m * ldx + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(live, w[r] + k);
      for (int m = 0; m < MT; ++m) a[m * R + r] = _mm512_dpbf16_ps(a[m * R + r], xv[m], wv);
    }
  }
  pf.p = pp;
  return reduce16(a);
}
#endif

// tile_rows (step.cpp) for bf16: tile_b16<16, 1>'s and tile_dp<16, 1>'s sums, the same bits, row after row.
inline __m512 tile_rows_b16(const bf16* const w[16], const float* x, int64_t K, const RowStream& pf) {
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
  const int64_t K32 = K / 32 * 32, K16 = K / 16 * 16;
  for (int r = 0; r < 16; ++r) {
    for (int64_t k = 0; k < K32; k += 32) {
      pf.line(r, 2 * k);
      const __m512i v = _mm512_loadu_si512(w[r] + k);
      a[r] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), _mm512_loadu_ps(x + k), a[r]);
      a[r] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v, hi)), _mm512_loadu_ps(x + k + 16), a[r]);
    }
    if (K32 < K16) {
      pf.line(r, 2 * K32);
      a[r] = _mm512_fmadd_ps(load16(w[r] + K32), _mm512_loadu_ps(x + K32), a[r]);
    }
  }
  return reduce_tail<bf16, 16, 1>(a, w, x, K, K16, K);
}

#ifdef SLUICE_BF16_DOT
inline __m512 tile_rows_dp(const bf16* const w[16], const uint16_t* x, int64_t K, const RowStream& pf) {
  __m512 a[16];
  for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
  const int64_t K32 = K / 32 * 32;
  for (int r = 0; r < 16; ++r)
    for (int64_t k = 0; k < K32; k += 32) {
      pf.line(r, 2 * k);
      a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_loadu_si512(x + k), (__m512bh)_mm512_loadu_si512(w[r] + k));
    }
  if (K32 < K) {
    const __mmask32 live = static_cast<__mmask32>((uint64_t{1} << (K - K32)) - 1);
    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(live, x + K32);
    for (int r = 0; r < 16; ++r) {
      pf.line(r, 2 * K32);
      a[r] = _mm512_dpbf16_ps(a[r], xv, (__m512bh)_mm512_maskz_loadu_epi16(live, w[r] + K32));
    }
  }
  return reduce16(a);
}
#endif

// Decode's tile (M = 1) for W's weights, as tile_w's with R = 16, MT = 1, row after row.
template <typename W>
inline __m512 tile_rows_w(const W* const w[16], const float* x, const B16In* in, int64_t K, const RowStream& pf) {
  if constexpr (std::is_same_v<W, bf16>) {
#ifdef SLUICE_BF16_DOT
    if (in->dot) return tile_rows_dp(w, in->xb, K, pf);
#endif
    return tile_rows_b16(w, in->xd, K, pf);
  } else {
    return tile_rows<W>(w, x, K, pf);
  }
}

// The tile block() runs for W's weights over input rows m0.. (x: row 0 of M, K apart): bf16 ones read this thread's
// prepared input (b16_input) in the Step's mode, others x itself.
template <typename W, int R, int MT, int Pf = 0>
inline __m512 tile_w(const W* const w[R], const float* x, const B16In* in, int64_t m0, int64_t K, Prefetch& pf) {
  if constexpr (std::is_same_v<W, bf16>) {
#ifdef SLUICE_BF16_DOT
    if (in->dot) return tile_dp<R, MT, Pf>(w, in->xb + m0 * K, K, K, pf);
#endif
    return tile_b16<R, MT, Pf>(w, in->xd + m0 * K, K, K, pf);
  } else {
    return tile<W, R, MT, Pf>(w, x + m0 * K, K, K, pf);
  }
}

// Where a linear's input is final (before its `omp for`): this thread's prepared input for a bf16 L.
inline void b16_prepare(const Linear& L, const float* x, int64_t M) {
  if (L.kind == kBf16) b16_input(L, x, M);
}
#else
struct B16In {};
inline void b16_prepare(const Linear&, const float*, int64_t) {}
#endif

// Whether this build has the bf16 dot mode (fast_step.py refuses it where not).
inline bool has_bf16_dot() {
#ifdef SLUICE_BF16_DOT
  return true;
#else
  return false;
#endif
}
