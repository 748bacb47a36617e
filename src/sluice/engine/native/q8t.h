// step.cpp's integer-dot mode for int8 weights (fast_step.INT8_DOT "int8", the default; Linear::idot on a kInt8
// linear): every product of the step, decode and prefill, so that a token's numbers never depend on how many rows
// shared its call. Included by step.cpp after q4.h (it uses q4i.h's rounding and Q4In) and before block().
//
// Why: widening the codes to fp32 and multiplying in fp32 made an int8 prefill compute-bound at the fp32 FMA rate
// (16 products per instruction with AVX-512). Here, as q4i.h does for int4 and llama.cpp for Q8_0 x Q8_0, each
// activation row is rounded per block of 32 inputs to int8 (q4i_round: d = max|x| / 127, a = rint(x / d)) and
// per weight row and block the integer sum isum_b = sum(w a) is exact in int32; then
//   y = s * (sum over blocks b, in order, of isum_b * d_b) + bias,
// the fp32 part one lane's (or one scalar's) fixed sequence: acc = isum_0 d_0, then acc = fma(isum_b, d_b, acc),
// then acc times the row's scale s rounded (scaled()), then the bias, then the residual. isum_b is at most
// 32 * 128 * 127 < 2^24, so its conversion to fp32 is exact. The price is the rounding of x: about 2^-8 of each
// block's largest |x| per input (bounds: tests/engine/test_fast_step_int8_dot.py).
//
// Tiles (SIMD builds): kQ8Rows weight rows (16 with AVX-512, 8 with AVX2) interleaved so that a vector lane holds
// one row and no horizontal sum is ever taken. Per block of 32 inputs, 8 vectors; lane r of vector i holds row r's
// codes 4i..4i+3 of the block, stored biased, u = w + 128 (u8), because vpdpbusd multiplies u8 by s8:
// sum(u a) = sum(w a) + 128 sum(a), so its accumulator starts at -128 sum(a) (made per token row and block with
// the codes of x). Without VNNI, the codes unbiased (w = u ^ 0x80) multiply |w| by a with w's sign (maddubs, whose
// pair sums 2 * 128 * 127 stay below 2^15), summed to int32 at once: the same integer. A tile is one contiguous
// stream of Kq / 32 blocks of kQ8Rows * 32 bytes (Kq: K rounded up to 32; rows past N and inputs past K hold
// code 0). The step holds this copy beside the module's codes: the same number of bytes again (the module's
// row-major codes stay for the torch path), one copy that decode and prefill both read.
//
// Without SIMD, the scalar loops read the module's codes in place and compute the same integers and the same fp32
// sequence, so every build gives the same bits.

// x (M rows of L.k floats) rounded for the int8 dot into this thread's buffers (valid until its next call), as a
// Q4In: codes a (M, Kq), per row and block the scale d and c = -128 sum(a) (nb = Kq / 32 blocks a row).
inline Q4In q8t_input(const Linear& L, const float* x, int64_t M) {
  static thread_local std::vector<int8_t> codes;
  static thread_local Scratch scales;
  static thread_local std::vector<int32_t> corr;
  const int64_t K = L.k, B = (K + kQ4Block - 1) / kQ4Block, Kq = B * kQ4Block;
  if (static_cast<int64_t>(codes.size()) < M * Kq) codes.resize(M * Kq);
  if (static_cast<int64_t>(scales.size()) < M * B) scales.resize(M * B), corr.resize(M * B);
  Q4In in;
  in.a = codes.data();
  in.d = scales.data();
  in.c = corr.data();
  in.nb = B;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < B; ++b) {
      const float* xb = x + m * K + b * kQ4Block;
      alignas(64) float last[kQ4Block] = {};  // a block past K: its inputs there are zeros
      if ((b + 1) * kQ4Block > K) {
        std::copy(xb, x + (m + 1) * K, last);
        xb = last;
      }
      float d;
      corr[m * B + b] = -128 * q4i_round(xb, codes.data() + m * Kq + b * kQ4Block, d);
      scales[m * B + b] = d;
    }
  return in;
}

// y[m, n - n0] (+)= the integer dot's sum for weight row n and token row m, times the row's scale, plus its bias.
inline void q8t_put(const Linear& L, int64_t m, int64_t n, float acc, float* y, int64_t ldy, int64_t n0,
                    bool accumulate) {
  const float e = scaled(acc, L.s, n) + (L.b ? L.b[n] : 0.f);
  float& dst = y[m * ldy + n - n0];
  dst = accumulate ? dst + e : e;
}

#ifdef SLUICE_AVX512
constexpr int64_t kQ8Rows = 16, kQ8tRows = 4;  // weight rows a tile, token rows a pass over it
using Q8F = __m512;
using Q8I = __m512i;
inline Q8I q8t_load(const uint8_t* p) { return _mm512_load_si512(p); }
inline Q8I q8t_set1(int32_t v) { return _mm512_set1_epi32(v); }
inline Q8I q8t_add(Q8I a, Q8I b) { return _mm512_add_epi32(a, b); }
inline Q8F q8t_cvt(Q8I v) { return _mm512_cvtepi32_ps(v); }
inline Q8F q8t_f(float v) { return _mm512_set1_ps(v); }
inline Q8F q8t_mul(Q8F a, Q8F b) { return _mm512_mul_ps(a, b); }
inline Q8F q8t_fma(Q8F a, Q8F b, Q8F c) { return _mm512_fmadd_ps(a, b, c); }
inline void q8t_store(float* o, Q8F v) { _mm512_store_ps(o, v); }
#ifdef __AVX512VNNI__
#define SLUICE_Q8_VNNI 1
inline Q8I q8t_dot(Q8I s, Q8I u, int32_t a4) { return _mm512_dpbusd_epi32(s, u, _mm512_set1_epi32(a4)); }
#else
// The weights' sign as a mask and |w|: made once per weight vector, shared by the tile's token rows.
struct Q8W {
  __mmask64 neg;
  Q8I mag;
};
inline Q8W q8t_unbias(Q8I u) {
  const Q8I w = _mm512_xor_si512(u, _mm512_set1_epi8(static_cast<char>(0x80)));
  return {_mm512_movepi8_mask(w), _mm512_abs_epi8(w)};
}
inline Q8I q8t_dot(Q8I s, const Q8W& w, int32_t a4) {
  const Q8I a = _mm512_set1_epi32(a4), sa = _mm512_mask_sub_epi8(a, w.neg, _mm512_setzero_si512(), a);
  return _mm512_add_epi32(s, _mm512_madd_epi16(_mm512_maddubs_epi16(w.mag, sa), _mm512_set1_epi16(1)));
}
#endif
#elif defined(SLUICE_AVX2)
constexpr int64_t kQ8Rows = 8, kQ8tRows = 2;
using Q8F = __m256;
using Q8I = __m256i;
inline Q8I q8t_load(const uint8_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }
inline Q8I q8t_set1(int32_t v) { return _mm256_set1_epi32(v); }
inline Q8I q8t_add(Q8I a, Q8I b) { return _mm256_add_epi32(a, b); }
inline Q8F q8t_cvt(Q8I v) { return _mm256_cvtepi32_ps(v); }
inline Q8F q8t_f(float v) { return _mm256_set1_ps(v); }
inline Q8F q8t_mul(Q8F a, Q8F b) { return _mm256_mul_ps(a, b); }
inline Q8F q8t_fma(Q8F a, Q8F b, Q8F c) { return _mm256_fmadd_ps(a, b, c); }
inline void q8t_store(float* o, Q8F v) { _mm256_store_ps(o, v); }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SLUICE_Q8_VNNI 1
inline Q8I q8t_dot(Q8I s, Q8I u, int32_t a4) { return _mm256_dpbusd_epi32(s, u, _mm256_set1_epi32(a4)); }
#elif defined(__AVXVNNI__)
#define SLUICE_Q8_VNNI 1
inline Q8I q8t_dot(Q8I s, Q8I u, int32_t a4) { return _mm256_dpbusd_avx_epi32(s, u, _mm256_set1_epi32(a4)); }
#else
struct Q8W {
  Q8I sign, mag;
};
inline Q8W q8t_unbias(Q8I u) {
  const Q8I w = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));
  return {w, _mm256_abs_epi8(w)};
}
inline Q8I q8t_dot(Q8I s, const Q8W& w, int32_t a4) {
  const Q8I sa = _mm256_sign_epi8(_mm256_set1_epi32(a4), w.sign);
  return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(w.mag, sa), _mm256_set1_epi16(1)));
}
#endif
#else
constexpr int64_t kQ8Rows = 0;  // no tiles: block_q8's scalar loops over the module's codes
#endif

// L's codes in tiles (the layout above), biased; sets L.wt, L.ldt and L.tile. Empty without SIMD.
inline torch::Tensor q8t_pack(Linear& L) {
  if (!kQ8Rows) return {};
  const int64_t R = std::max<int64_t>(kQ8Rows, 1), B = (L.k + kQ4Block - 1) / kQ4Block, T = (L.n + R - 1) / R;
  torch::Tensor out = huge_zeros(T * B * R * kQ4Block + 64);
  uint8_t* const o = out.data_ptr<uint8_t>() + (64 - reinterpret_cast<uintptr_t>(out.data_ptr<uint8_t>()) % 64) % 64;
  const int8_t* w = static_cast<const int8_t*>(L.w);
  uint8_t* p = o;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < 8; ++i)
        for (int64_t r = 0; r < R; ++r)
          for (int64_t j = 0; j < 4; ++j, ++p) {
            const int64_t n = t * R + r, k = b * kQ4Block + 4 * i + j;
            *p = static_cast<uint8_t>(n < L.n && k < L.k ? w[n * L.ldw + k] : 0) ^ 0x80;
          }
  L.wt = o;
  L.ldt = B * R * kQ4Block;
  L.tile = R;
  return out;
}

#if defined(SLUICE_AVX2)
// out[m] lane r = the fp32 sum (before the scale) of the tile's weight row r with token row m0 + m, MT token rows;
// pf: pf_step lines a block of the stream to prefetch (null: none).
template <int MT>
inline void q8t_tile(const uint8_t* t, int64_t B, const Q4In& in, int64_t m0, Q8F out[MT], const char* pf,
                     int64_t pf_step, bool far) {
  const int64_t Kq = B * kQ4Block;
  Q8F acc[MT];
  for (int64_t b = 0; b < B; ++b, t += kQ8Rows * kQ4Block) {
    if (pf)
      for (int64_t j = 0; j < pf_step; ++j, pf += 64) {
        if (far) _mm_prefetch(pf, _MM_HINT_T1);
        else _mm_prefetch(pf, _MM_HINT_T0);
      }
    // Two chains per token row (vectors 0-3, 4-7), so decode's lone row does not wait on one chain of 8 dots;
    // integer sums are exact in any order.
    Q8I s[MT][2];
    const int8_t* a[MT];
    for (int m = 0; m < MT; ++m) {
      s[m][0] = q8t_set1(
#ifdef SLUICE_Q8_VNNI
          in.c[(m0 + m) * B + b]  // sum(u a) = sum(w a) + 128 sum(a)
#else
          0
#endif
      );
      s[m][1] = q8t_set1(0);
      a[m] = in.a + (m0 + m) * Kq + b * kQ4Block;
    }
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
#ifdef SLUICE_Q8_VNNI
      const Q8I w = q8t_load(t + i * kQ8Rows * 4);
#else
      const Q8W w = q8t_unbias(q8t_load(t + i * kQ8Rows * 4));
#endif
      for (int m = 0; m < MT; ++m) {
        int32_t a4;
        std::memcpy(&a4, a[m] + 4 * i, 4);
        s[m][i / 4] = q8t_dot(s[m][i / 4], w, a4);
      }
    }
    for (int m = 0; m < MT; ++m) {
      const Q8F f = q8t_cvt(q8t_add(s[m][0], s[m][1])), d = q8t_f(in.d[(m0 + m) * B + b]);
      acc[m] = b == 0 ? q8t_mul(f, d) : q8t_fma(f, d, acc[m]);
    }
  }
  for (int m = 0; m < MT; ++m) out[m] = acc[m];
}
#endif

// block()'s int8-dot form (in from q8t_input): y[m, n - n0] (+)= x[m] . W[n] + b[n]. SIMD builds: over tiles, every
// group of kQ8tRows token rows over a tile before the next tile (its bytes stay in L1/L2: a prefill chunk reads
// the weights once), the first group prefetching the next tile (or `after`, another linear's first rows).
// The walk is q4t.h's block_q4t's, written out again: one template for both (the tile call and the output as
// lambdas) decoded int8 15-20% slower here (GCC 12, AMD Zen 4, 2026-12-03, two alternating runs of
// `sluice bench --quantize int8`), so each format keeps its own loop.
inline void block_q8(const Linear& L, const Q4In& in, int64_t M, int64_t n0, int64_t n1, float* y, int64_t ldy,
                     bool accumulate, const void* after) {
  const int64_t B = in.nb;
#ifdef SLUICE_AVX2
  const int64_t R = kQ8Rows;
  for (int64_t n = n0 / R * R; n < n1; n += R) {
    const uint8_t* t = L.wt + n / R * L.ldt;
    const void* next = n + R >= n1 && after ? after : L.row(n + R);
    const int64_t pf_step = (L.ldt / 64 + B - 1) / B;
    for (int64_t m0 = 0; m0 < M; m0 += kQ8tRows) {
      const int64_t mm = std::min(kQ8tRows, M - m0);
      const char* pf = m0 == 0 ? static_cast<const char*>(next) : nullptr;
      Q8F o[kQ8tRows];
      switch (mm) {
        case 1: q8t_tile<1>(t, B, in, m0, o, pf, pf_step, L.far); break;
#ifdef SLUICE_AVX512
        case 2: q8t_tile<2>(t, B, in, m0, o, pf, pf_step, L.far); break;
        case 3: q8t_tile<3>(t, B, in, m0, o, pf, pf_step, L.far); break;
        default: q8t_tile<4>(t, B, in, m0, o, pf, pf_step, L.far);
#else
        default: q8t_tile<2>(t, B, in, m0, o, pf, pf_step, L.far);
#endif
      }
      const int64_t r0 = std::max(n, n0) - n, r1 = std::min(n + R, n1) - n;  // the rows of [n0, n1) in the tile
      for (int64_t m = 0; m < mm; ++m) {
        alignas(64) float v[kQ8Rows];
        q8t_store(v, o[m]);
        for (int64_t r = r0; r < r1; ++r) q8t_put(L, m0 + m, n + r, v[r], y, ldy, n0, accumulate);
      }
    }
  }
#else
  (void)after;
  const int8_t* w = static_cast<const int8_t*>(L.w);
  const int64_t Kq = B * kQ4Block;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.f;
      for (int64_t b = 0; b < B; ++b) {
        int isum = 0;
        for (int64_t k = b * kQ4Block; k < std::min(L.k, (b + 1) * kQ4Block); ++k)
          isum += w[n * L.ldw + k] * in.a[m * Kq + k];
        const float f = static_cast<float>(isum), d = in.d[m * B + b];
        acc = b == 0 ? f * d : std::fma(f, d, acc);
      }
      q8t_put(L, m, n, acc, y, ldy, n0, accumulate);
    }
#endif
}
