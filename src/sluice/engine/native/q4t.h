// q4i.h's integer dot over tiles of interleaved weight rows (SIMD builds): a vector lane per weight row, so a
// block's scale and zero apply lane by lane and no horizontal sum is ever taken. Included by q4i.h.
//
// Why: with a lane per input (the tiles before these) every weight row paid per block of 32 a code unpack, a dot, a scale
// broadcast and at the end a horizontal sum, and per group its scale and zero as scalars: ~15 instructions per
// 32 weights, so int4 decode was compute-bound at ~40% of the read bandwidth. Here kQ4Rows rows (16 in the
// AVX-512 build, 8 in the AVX2 one) are one tile: per block of 32 inputs, four vectors whose 32-bit lane r holds
// 4 bytes of row r (byte 4i + j of a row's block in vector i: codes of inputs 4i + j, low nibble, and 16 + 4i + j,
// high nibble, the nibble layout of quant.py). A mask and a shift give 8 vectors of u8 codes; each takes one dot
// (VNNI dpbusd, or maddubs) with 4 activation bytes broadcast, so a lane sums its row's block exactly in int32.
// Per tile and group the rows' (s, z) pairs lie before the group's codes (one vector load, as q4_scales<16>),
// so a tile is one contiguous stream: T = ceil(N / kQ4Rows) tiles of G groups of kQ4Rows * 4 + per * kQ4Rows * 16
// bytes. The step holds this copy beside the module's codes (q4t_pack), the same number of bytes.
//
// Per (weight row, token row) the fp32 part is: per group gacc = sum over its blocks of isum_b * d_b in order,
// then acc = fma(s, gacc, acc), acc = fma(c, dsum_g, acc), over groups in order; a lane computes exactly that in
// both builds, whatever the tile's number of token rows, so a token's numbers do not depend on its batch or
// chunk, and the AVX2 and AVX-512 builds give the same bits.

#ifdef SLUICE_AVX512
constexpr int64_t kQ4Rows = 16;
using Q4F = __m512;
using Q4I = __m512i;
inline Q4I q4t_load(const uint8_t* p) { return _mm512_load_si512(p); }
inline Q4I q4t_bcast(const int8_t* a) {
  int32_t v;
  std::memcpy(&v, a, 4);
  return _mm512_set1_epi32(v);
}
inline Q4F q4t_f(float v) { return _mm512_set1_ps(v); }
inline Q4F q4t_cvt(Q4I v) { return _mm512_cvtepi32_ps(v); }
inline Q4F q4t_mul(Q4F a, Q4F b) { return _mm512_mul_ps(a, b); }
inline Q4F q4t_fma(Q4F a, Q4F b, Q4F c) { return _mm512_fmadd_ps(a, b, c); }
inline Q4F q4t_zero() { return _mm512_setzero_ps(); }
inline void q4t_store(float* o, Q4F v) { _mm512_store_ps(o, v); }
// codes of vector P: low nibbles (inputs 4i + j) and high ones (16 + 4i + j)
inline void q4t_unpack(const uint8_t* p, Q4I& lo, Q4I& hi) {
  const Q4I v = q4t_load(p), m = _mm512_set1_epi8(15);
  lo = _mm512_and_si512(v, m);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
}
// (s, c = z - 8 s) of the tile's rows for a group, from its kQ4Rows (s, z) bf16 pairs (as q4_scales)
inline void q4t_scales(const uint8_t* p, Q4F& s, Q4F& c) {
  const Q4I v = q4t_load(p);
  s = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  c = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), s,
                       _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)))));
}
// Lane r: sum over the block of row r's codes q times the activation codes a (exact in int32 on every path).
inline Q4I q4t_isum(const Q4I q[8], const int8_t* a) {
#ifdef __AVX512VNNI__
  Q4I s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0], q4t_bcast(a));
  Q4I s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[4], q4t_bcast(a + 16));
  for (int i = 1; i < 4; ++i) {
    s0 = _mm512_dpbusd_epi32(s0, q[i], q4t_bcast(a + 4 * i));
    s1 = _mm512_dpbusd_epi32(s1, q[4 + i], q4t_bcast(a + 16 + 4 * i));
  }
  return _mm512_add_epi32(s0, s1);
#else  // int16 pair sums of at most 2 * 15 * 127; eight of them stay below 2^15
  Q4I h = _mm512_maddubs_epi16(q[0], q4t_bcast(a));
  for (int i = 1; i < 8; ++i) h = _mm512_add_epi16(h, _mm512_maddubs_epi16(q[i], q4t_bcast(a + 4 * (i % 4) + 16 * (i / 4))));
  return _mm512_madd_epi16(h, _mm512_set1_epi16(1));
#endif
}
#elif defined(SLUICE_AVX2)
constexpr int64_t kQ4Rows = 8;
using Q4F = __m256;
using Q4I = __m256i;
inline Q4I q4t_load(const uint8_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }
inline Q4I q4t_bcast(const int8_t* a) {
  int32_t v;
  std::memcpy(&v, a, 4);
  return _mm256_set1_epi32(v);
}
inline Q4F q4t_f(float v) { return _mm256_set1_ps(v); }
inline Q4F q4t_cvt(Q4I v) { return _mm256_cvtepi32_ps(v); }
inline Q4F q4t_mul(Q4F a, Q4F b) { return _mm256_mul_ps(a, b); }
inline Q4F q4t_fma(Q4F a, Q4F b, Q4F c) { return _mm256_fmadd_ps(a, b, c); }
inline Q4F q4t_zero() { return _mm256_setzero_ps(); }
inline void q4t_store(float* o, Q4F v) { _mm256_store_ps(o, v); }
inline void q4t_unpack(const uint8_t* p, Q4I& lo, Q4I& hi) {
  const Q4I v = q4t_load(p), m = _mm256_set1_epi8(15);
  lo = _mm256_and_si256(v, m);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
}
inline void q4t_scales(const uint8_t* p, Q4F& s, Q4F& c) {
  const Q4I v = q4t_load(p);
  s = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  c = _mm256_fnmadd_ps(_mm256_set1_ps(8.f), s,
                       _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)))));
}
inline Q4I q4t_isum(const Q4I q[8], const int8_t* a) {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SLUICE_DPBUSD256 _mm256_dpbusd_epi32
#else
#define SLUICE_DPBUSD256 _mm256_dpbusd_avx_epi32
#endif
  Q4I s0 = SLUICE_DPBUSD256(_mm256_setzero_si256(), q[0], q4t_bcast(a));
  Q4I s1 = SLUICE_DPBUSD256(_mm256_setzero_si256(), q[4], q4t_bcast(a + 16));
  for (int i = 1; i < 4; ++i) {
    s0 = SLUICE_DPBUSD256(s0, q[i], q4t_bcast(a + 4 * i));
    s1 = SLUICE_DPBUSD256(s1, q[4 + i], q4t_bcast(a + 16 + 4 * i));
  }
#undef SLUICE_DPBUSD256
  return _mm256_add_epi32(s0, s1);
#else  // int16 pair sums of at most 2 * 15 * 127; eight of them stay below 2^15
  Q4I h = _mm256_maddubs_epi16(q[0], q4t_bcast(a));
  for (int i = 1; i < 8; ++i) h = _mm256_add_epi16(h, _mm256_maddubs_epi16(q[i], q4t_bcast(a + 4 * (i % 4) + 16 * (i / 4))));
  return _mm256_madd_epi16(h, _mm256_set1_epi16(1));
#endif
}
#else
constexpr int64_t kQ4Rows = 0;  // no tiles: block_q4i's scalar loops
#endif

// L's codes and (s, z) pairs in tiles (the layout above), zeros for the rows past N; sets L.wt and L.ldt.
inline torch::Tensor q4t_pack(Linear& L) {
  if (!kQ4Rows) return {};
  const int64_t R = std::max<int64_t>(kQ4Rows, 1), Kp = 2 * L.ldw, G = Kp / L.group, per = L.group / kQ4Block, seg = R * 4 + per * R * 16;
  const int64_t T = (L.n + R - 1) / R;
  torch::Tensor out = huge_zeros(T * G * seg + 64);
  uint8_t* const o = out.data_ptr<uint8_t>() + (64 - reinterpret_cast<uintptr_t>(out.data_ptr<uint8_t>()) % 64) % 64;
  const uint8_t* w = static_cast<const uint8_t*>(L.w);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < G; ++g) {
      uint8_t* s = o + (t * G + g) * seg;
      for (int64_t r = 0; r < R && t * R + r < L.n; ++r) {
        const int64_t n = t * R + r;
        std::memcpy(s + 4 * r, L.sz + 2 * (g * L.ldsz + n), 4);
        for (int64_t b = 0; b < per; ++b)
          for (int64_t i = 0; i < 4; ++i)
            std::memcpy(s + R * 4 + (b * 4 + i) * R * 4 + 4 * r, w + n * L.ldw + (g * per + b) * 16 + 4 * i, 4);
      }
    }
  L.wt = o;
  L.ldt = G * seg;
  L.tile = R;
  return out;
}

#if defined(SLUICE_AVX2)
// out[m] lane r = the tile's weight row r . token row m0 + m (before bias), MT token rows; pf: pf_step lines a group.
template <int MT, int GS>
inline void q4t_tile(const uint8_t* t, const Linear& L, const Q4In& in, int64_t m0, Q4F out[MT], const char* pf,
                     int64_t pf_step, bool far) {
  constexpr int64_t per = GS / kQ4Block, seg = kQ4Rows * 4 + per * kQ4Rows * 16;
  const int64_t Kp = 2 * L.ldw, G = Kp / GS;
  Q4F acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = q4t_zero();
  for (int64_t g = 0; g < G; ++g, t += seg) {
    if (pf)
      for (int64_t j = 0; j < pf_step; ++j, pf += 64) {
        if (far) _mm_prefetch(pf, _MM_HINT_T1);
        else _mm_prefetch(pf, _MM_HINT_T0);
      }
    Q4F s, c, gacc[MT];
    q4t_scales(t, s, c);
#pragma GCC unroll 8
    for (int64_t b = 0; b < per; ++b) {
      const uint8_t* p = t + kQ4Rows * 4 + b * kQ4Rows * 16;
      Q4I q[8];
      for (int i = 0; i < 4; ++i) q4t_unpack(p + i * kQ4Rows * 4, q[i], q[4 + i]);
      const int64_t k = g * GS + b * kQ4Block;
      for (int m = 0; m < MT; ++m) {
        const Q4F f = q4t_cvt(q4t_isum(q, in.a + (m0 + m) * Kp + k)), d = q4t_f(in.d[(m0 + m) * in.nb + k / kQ4Block]);
        gacc[m] = b == 0 ? q4t_mul(f, d) : q4t_fma(f, d, gacc[m]);
      }
    }
    for (int m = 0; m < MT; ++m) {
      acc[m] = q4t_fma(s, gacc[m], acc[m]);
      acc[m] = q4t_fma(c, q4t_f(in.dsum[(m0 + m) * in.ng + g]), acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) out[m] = acc[m];
}

template <int MT>
inline void q4t_tile_g(const uint8_t* t, const Linear& L, const Q4In& in, int64_t m0, Q4F out[MT], const char* pf,
                       int64_t pf_step, bool far) {
  switch (L.group) {
    case 32: return q4t_tile<MT, 32>(t, L, in, m0, out, pf, pf_step, far);
    case 64: return q4t_tile<MT, 64>(t, L, in, m0, out, pf, pf_step, far);
    case 128: return q4t_tile<MT, 128>(t, L, in, m0, out, pf, pf_step, far);
    default: return q4t_tile<MT, 256>(t, L, in, m0, out, pf, pf_step, far);
  }
}

#ifdef SLUICE_AVX512
constexpr int64_t kQ4tRows = 4;  // token rows per tile: 4 x 2 accumulators + 8 codes of 32 registers
#else
constexpr int64_t kQ4tRows = 2;  // of 16
#endif

// block_q4i over tiles (L.wt set): y[m, n - n0] (+)= x[m] . W[n] + b[n], every group of kQ4tRows token rows over a
// tile before the next tile (its bytes stay in L1: a prefill chunk reads the weights once); the first group
// prefetches the next rows (the next tile, or `after`, another linear's first rows) a few lines per group.
inline void block_q4t(const Linear& L, const Q4In& in, int64_t M, int64_t n0, int64_t n1, float* y, int64_t ldy,
                      bool accumulate, const void* after) {
  const int64_t R = kQ4Rows, G = 2 * L.ldw / L.group;
  for (int64_t n = n0 / R * R; n < n1; n += R) {
    const uint8_t* t = L.wt + n / R * L.ldt;
    const void* next = n + R >= n1 && after ? after : L.row(n + R);
    const int64_t pf_step = (L.ldt / 64 + G - 1) / G;
    for (int64_t m0 = 0; m0 < M; m0 += kQ4tRows) {
      const int64_t mm = std::min(kQ4tRows, M - m0);
      const char* pf = m0 == 0 ? static_cast<const char*>(next) : nullptr;
      Q4F o[kQ4tRows];
      switch (mm) {
        case 1: q4t_tile_g<1>(t, L, in, m0, o, pf, pf_step, L.far); break;
#ifdef SLUICE_AVX512
        case 2: q4t_tile_g<2>(t, L, in, m0, o, pf, pf_step, L.far); break;
        case 3: q4t_tile_g<3>(t, L, in, m0, o, pf, pf_step, L.far); break;
        default: q4t_tile_g<4>(t, L, in, m0, o, pf, pf_step, L.far);
#else
        default: q4t_tile_g<2>(t, L, in, m0, o, pf, pf_step, L.far);
#endif
      }
      const int64_t r0 = std::max(n, n0) - n, r1 = std::min(n + R, n1) - n;  // the rows of [n0, n1) in the tile
      for (int64_t m = 0; m < mm; ++m) {
        alignas(64) float v[kQ4Rows];
        q4t_store(v, o[m]);
        float* ym = y + (m0 + m) * ldy + n - n0;
        for (int64_t r = r0; r < r1; ++r) {
          const float e = v[r] + (L.b ? L.b[n + r] : 0.f);
          ym[r] = accumulate ? ym[r] + e : e;
        }
      }
    }
  }
}
#endif
