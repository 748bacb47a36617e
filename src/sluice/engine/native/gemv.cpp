// sluice's decode linear: y = x W^T (+ b) for 1-8 rows of x, streaming W once.
//
// At decode time x has 1..8 rows and W is read from DRAM once per token, so the product is a
// memory stream, not arithmetic. This kernel walks W row by row (each output is one dot product
// of a W row with every x row), splits the rows across torch's intra-op threads, and widens bf16
// (a 16-bit shift) or int8 (with a per-row scale) to fp32 in registers, so W is read at its
// stored width and never copied. Accumulation is fp32. Built once per machine (build.py) with
// -march=native: AVX2 + FMA intrinsics where the compiler has them, a plain loop otherwise (simd.h).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "simd.h"

namespace {

using namespace sluice_simd;

constexpr int kMaxRows = 8;

// out[m] = dot(w[0:K], x[m, 0:K]) for m < M; x is fp32 (M, K) contiguous. Two accumulators per x
// row hide the FMA latency. (Walking 2-4 W rows at once, with software prefetch, measured slower
// on the AVX2 EPYC: docs/changelog-benchmarks.md, 2026-11-30 "Fast decode".)
template <typename W, int M>
inline void dot_rows(const W* w, const float* x, int64_t K, float* out) {
  int64_t k = 0;
#ifdef SLUICE_AVX2
  __m256 acc0[M], acc1[M];
  for (int m = 0; m < M; ++m) { acc0[m] = _mm256_setzero_ps(); acc1[m] = _mm256_setzero_ps(); }
  for (; k + 16 <= K; k += 16) {
    __m256 w0 = load8(w + k), w1 = load8(w + k + 8);
    for (int m = 0; m < M; ++m) {
      acc0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * K + k), acc0[m]);
      acc1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * K + k + 8), acc1[m]);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = hsum(_mm256_add_ps(acc0[m], acc1[m]));
#else
  for (int m = 0; m < M; ++m) out[m] = 0.f;
#endif
  for (; k < K; ++k) {
    float wk = widen(w[k]);
    for (int m = 0; m < M; ++m) out[m] += wk * x[m * K + k];
  }
}

// One x row: four accumulators over 32 weights per step (more loads in flight than two), and a
// software prefetch 1 KiB ahead in the stream. Measured on the AVX2 EPYC (docs/benchmarks.md, "Fast
// decode"): bf16 weights stream at 15-20 GB/s this way against 9-10 with the two-accumulator loop
// and 10-13 for torch's F.linear; the prefetch adds about 10% on top of the accumulators.
template <typename W>
inline float dot_one(const W* w, const float* x, int64_t K) {
  int64_t k = 0;
  float out = 0.f;
#ifdef SLUICE_AVX2
  constexpr int kAhead = 1024;  // bytes
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; k + 32 <= K; k += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k) + kAhead, _MM_HINT_T0);
    if (sizeof(W) == 4) _mm_prefetch(reinterpret_cast<const char*>(w + k) + kAhead + 64, _MM_HINT_T0);
    a0 = _mm256_fmadd_ps(load8(w + k), _mm256_loadu_ps(x + k), a0);
    a1 = _mm256_fmadd_ps(load8(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
    a2 = _mm256_fmadd_ps(load8(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
    a3 = _mm256_fmadd_ps(load8(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
  }
  out = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
  for (; k < K; ++k) out += widen(w[k]) * x[k];
  return out;
}

template <typename W, int M>
void gemv_rows(const W* w, const float* x, const float* scale, const float* bias, float* y,
               int64_t N, int64_t K) {
  // torch's thread pool splits the W rows into one contiguous run per thread.
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    float acc[M];
    for (int64_t n = begin; n < end; ++n) {
      if (M == 1) acc[0] = dot_one<W>(w + n * K, x, K);
      else dot_rows<W, M>(w + n * K, x, K, acc);
      float s = scale ? scale[n] : 1.f, b = bias ? bias[n] : 0.f;
      for (int m = 0; m < M; ++m) y[m * N + n] = acc[m] * s + b;
    }
  });
}

template <typename W>
void dispatch(const W* w, const float* x, const float* scale, const float* bias, float* y,
              int64_t M, int64_t N, int64_t K) {
  switch (M) {
    case 1: return gemv_rows<W, 1>(w, x, scale, bias, y, N, K);
    case 2: return gemv_rows<W, 2>(w, x, scale, bias, y, N, K);
    case 3: return gemv_rows<W, 3>(w, x, scale, bias, y, N, K);
    case 4: return gemv_rows<W, 4>(w, x, scale, bias, y, N, K);
    default:
      for (int64_t m0 = 0; m0 < M; m0 += 4) {  // 5..8 rows: two passes over W, still no copy
        int64_t mm = std::min<int64_t>(4, M - m0);
        // y rows m0.. are strided by N; write into a temporary then copy, keeping one layout.
        std::vector<float> part(mm * N);
        dispatch<W>(w, x + m0 * K, scale, bias, part.data(), mm, N, K);
        std::memcpy(y + m0 * N, part.data(), sizeof(float) * mm * N);
      }
  }
}

// ---------------------------------------------------------------- int8 weights times int8 x ("w8a8")
// Widening int8 weights to fp32 costs more instructions than their bytes save on AVX2 (the int8
// rows above read ~6.4 GB/s). Here x is quantized to int8 once per call instead, and each 32 weights
// meet 32 x codes in one integer multiply-add: |w| (unsigned) times sign(w)*x (signed) with maddubs,
// pairs summed to int32 with madd. x is symmetric per block of B inputs (B a multiple of 32, or the
// whole row): q = round(x * 127 / amax) in [-127, 127], d = amax / 127. An int32 sum per block is
// scaled by its d into an fp32 accumulator; the weight's row scale is applied once at the end.
// AVX2 only: VNNI (vpdpbusd) would fuse maddubs + madd, but this machine lacks it, so it is untested
// and left out.
struct QuantX {
  std::vector<int8_t> q;  // (M, Kq), zero past x's K
  std::vector<float> d;   // (M, nb) block scales
  int64_t Kq, B, nb;
};

QuantX quantize_x(const float* x, int64_t M, int64_t Kx, int64_t Kw, int64_t block) {
  QuantX X;
  X.Kq = (Kw + 31) / 32 * 32;
  X.B = block <= 0 || block >= X.Kq ? X.Kq : block;
  X.nb = (X.Kq + X.B - 1) / X.B;
  X.q.assign(M * X.Kq, 0);
  X.d.assign(M * X.nb, 0.f);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < X.nb; ++b) {
      const int64_t lo = b * X.B, hi = std::min(lo + X.B, Kx);
      const float* xr = x + m * Kx;
      float amax = 0.f;
      bool finite = true;
      for (int64_t k = lo; k < hi; ++k) { amax = std::max(amax, std::fabs(xr[k])); finite &= std::isfinite(xr[k]); }
      if (!finite) { X.d[m * X.nb + b] = NAN; continue; }  // a non-finite input stays visible in the output
      if (amax == 0.f) continue;                             // an all-zero block: codes and scale 0
      // the same two IEEE divisions and one product as gemv.py's w8a8_reference, so the codes match it
      const float inv = 127.f / amax;
      X.d[m * X.nb + b] = amax / 127.f;
      for (int64_t k = lo; k < hi; ++k)
        X.q[m * X.Kq + k] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(xr[k] * inv))));
    }
  }
  return X;
}

// out[m] = sum over blocks b of d[m, b] * int_dot(w[block b], q[m, block b]), for M x rows.
template <int M>
inline void dot_q8(const int8_t* w, int64_t Kw, const int8_t* q, const float* d, const QuantX& X, float* out) {
#ifdef SLUICE_AVX2
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t whole = Kw / 32 * 32;  // steps past this read the row's tail from a zero-padded copy
  alignas(32) int8_t tail[32] = {0};
  if (whole < Kw) std::memcpy(tail, w + whole, Kw - whole);
  __m256 f[M];
  for (int m = 0; m < M; ++m) f[m] = _mm256_setzero_ps();
  for (int64_t b = 0, k = 0; b < X.nb; ++b) {
    const int64_t end = std::min(k + X.B, X.Kq);
    __m256i acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_si256();
    for (; k < end; k += 32) {
      if (M == 1) _mm_prefetch(reinterpret_cast<const char*>(w + k) + 1024, _MM_HINT_T0);
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k < whole ? w + k : tail));
      // |w| <= 128 (code -128 reads as unsigned 128) and |x| <= 127: a maddubs pair sum is at most
      // 2 * 128 * 127 = 32512 < 32767, so its int16 saturation never triggers.
      const __m256i wa = _mm256_sign_epi8(wv, wv);
      for (int m = 0; m < M; ++m) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + m * X.Kq + k));
        const __m256i p = _mm256_maddubs_epi16(wa, _mm256_sign_epi8(xv, wv));  // (int16) |w| * sign(w) x, pairs
        acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(p, ones));
      }
    }
    for (int m = 0; m < M; ++m)
      f[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]), _mm256_set1_ps(d[m * X.nb + b]), f[m]);
  }
  for (int m = 0; m < M; ++m) out[m] = hsum(f[m]);
#else
  for (int m = 0; m < M; ++m) {
    out[m] = 0.f;
    for (int64_t b = 0, k = 0; b < X.nb; ++b) {
      int32_t acc = 0;
      for (const int64_t end = std::min(k + X.B, X.Kq); k < end; ++k)
        acc += (k < Kw ? w[k] : 0) * q[m * X.Kq + k];
      out[m] += acc * d[m * X.nb + b];
    }
  }
#endif
}

#ifdef SLUICE_AVX2
// One x row with blocks of 32 (the default): each block ends in an FMA into the fp32 sum, a 4-5
// cycle dependency per 32 weights if there were one sum, so four sums take turns (as dot_one's four
// accumulators), and the stream is prefetched 1 KiB ahead.
inline float dot_q8_one_b32(const int8_t* w, int64_t Kw, const int8_t* q, const float* d, int64_t Kq) {
  const __m256i ones = _mm256_set1_epi16(1);
  auto dot32 = [&](const int8_t* wp, int64_t k) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp));
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k));
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
  };
  const int64_t whole = Kw / 32 * 32;
  __m256 f0 = _mm256_setzero_ps(), f1 = f0, f2 = f0, f3 = f0;
  int64_t k = 0;
  for (; k + 128 <= whole; k += 128) {
    _mm_prefetch(reinterpret_cast<const char*>(w + k) + 1024, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + k) + 1088, _MM_HINT_T0);
    const float* db = d + k / 32;
    f0 = _mm256_fmadd_ps(dot32(w + k, k), _mm256_set1_ps(db[0]), f0);
    f1 = _mm256_fmadd_ps(dot32(w + k + 32, k + 32), _mm256_set1_ps(db[1]), f1);
    f2 = _mm256_fmadd_ps(dot32(w + k + 64, k + 64), _mm256_set1_ps(db[2]), f2);
    f3 = _mm256_fmadd_ps(dot32(w + k + 96, k + 96), _mm256_set1_ps(db[3]), f3);
  }
  alignas(32) int8_t tail[32] = {0};
  if (whole < Kw) std::memcpy(tail, w + whole, Kw - whole);
  for (; k < Kq; k += 32) f0 = _mm256_fmadd_ps(dot32(k < whole ? w + k : tail, k), _mm256_set1_ps(d[k / 32]), f0);
  return hsum(_mm256_add_ps(_mm256_add_ps(f0, f1), _mm256_add_ps(f2, f3)));
}
#endif

template <int M>
void w8a8_rows(const int8_t* w, const QuantX& X, int64_t m0, const float* scale, const float* bias, float* y,
               int64_t N, int64_t K) {
  const int8_t* q = X.q.data() + m0 * X.Kq;
  const float* d = X.d.data() + m0 * X.nb;
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    float acc[M];
    for (int64_t n = begin; n < end; ++n) {
#ifdef SLUICE_AVX2
      if (M == 1 && X.B == 32) acc[0] = dot_q8_one_b32(w + n * K, K, q, d, X.Kq);
      else
#endif
      dot_q8<M>(w + n * K, K, q, d, X, acc);
      const float b = bias ? bias[n] : 0.f;
      for (int m = 0; m < M; ++m) y[(m0 + m) * N + n] = acc[m] * scale[n] + b;
    }
  });
}

// Up to 4 x rows per pass over W (the registers of 4 rows' int32 and fp32 accumulators fit in 16).
void w8a8_dispatch(const int8_t* w, const QuantX& X, const float* scale, const float* bias, float* y,
                   int64_t M, int64_t N, int64_t K) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    switch (std::min<int64_t>(4, M - m0)) {
      case 1: w8a8_rows<1>(w, X, m0, scale, bias, y, N, K); break;
      case 2: w8a8_rows<2>(w, X, m0, scale, bias, y, N, K); break;
      case 3: w8a8_rows<3>(w, X, m0, scale, bias, y, N, K); break;
      default: w8a8_rows<4>(w, X, m0, scale, bias, y, N, K);
    }
  }
}

}  // namespace

// x (M, K) any float dtype, w (N, K) float32 | bfloat16 | int8, scale (N,) float32 for int8,
// bias (N,) or undefined. Returns (M, N) in x's dtype.
torch::Tensor gemv(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> scale,
                   c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv: shapes (M, K) and (N, K)");
  TORCH_CHECK(x.size(0) <= kMaxRows, "gemv: at most 8 rows of x");
  TORCH_CHECK(w.is_contiguous() && x.device().is_cpu() && w.device().is_cpu(), "gemv: contiguous CPU weight");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  auto xf = x.to(torch::kFloat32).contiguous();
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
  torch::Tensor s, b;
  if (scale.has_value() && scale->defined()) s = scale->to(torch::kFloat32).contiguous();
  if (bias.has_value() && bias->defined()) b = bias->to(torch::kFloat32).contiguous();
  const float* sp = s.defined() ? s.data_ptr<float>() : nullptr;
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  switch (w.scalar_type()) {
    case torch::kFloat32: dispatch(w.data_ptr<float>(), xf.data_ptr<float>(), sp, bp, y.data_ptr<float>(), M, N, K); break;
    case torch::kBFloat16: dispatch(w.data_ptr<at::BFloat16>(), xf.data_ptr<float>(), sp, bp, y.data_ptr<float>(), M, N, K); break;
    case torch::kChar:
      TORCH_CHECK(sp != nullptr, "gemv: int8 weights need a per-row scale");
      dispatch(w.data_ptr<int8_t>(), xf.data_ptr<float>(), sp, bp, y.data_ptr<float>(), M, N, K); break;
    default: TORCH_CHECK(false, "gemv: weight dtype must be float32, bfloat16 or int8");
  }
  return y.to(x.scalar_type());
}

// x (M, Kx) any float dtype with Kx <= K (missing inputs are zeros: the padded columns), w (N, K)
// int8, scale (N,) float32, bias (N,) or undefined; x quantized in blocks of `xblock` inputs (a
// multiple of 32; 0 = one scale per row). Returns (M, N) in x's dtype.
torch::Tensor gemv_w8a8(torch::Tensor x, torch::Tensor w, torch::Tensor scale, c10::optional<torch::Tensor> bias,
                        int64_t xblock) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) <= w.size(1), "gemv_w8a8: shapes (M, K' <= K) and (N, K)");
  TORCH_CHECK(x.size(0) <= kMaxRows, "gemv_w8a8: at most 8 rows of x");
  TORCH_CHECK(w.scalar_type() == torch::kChar && w.is_contiguous() && x.device().is_cpu() && w.device().is_cpu(),
              "gemv_w8a8: contiguous int8 CPU weight");
  TORCH_CHECK(scale.numel() == w.size(0), "gemv_w8a8: one scale per weight row");
  TORCH_CHECK(xblock >= 0 && xblock % 32 == 0, "gemv_w8a8: x block size must be 0 (per row) or a multiple of 32");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  auto xf = x.to(torch::kFloat32).contiguous();
  auto s = scale.to(torch::kFloat32).contiguous();
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) b = bias->to(torch::kFloat32).contiguous();
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
  const QuantX X = quantize_x(xf.data_ptr<float>(), M, x.size(1), K, xblock);
  w8a8_dispatch(w.data_ptr<int8_t>(), X, s.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
                y.data_ptr<float>(), M, N, K);
  return y.to(x.scalar_type());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "batch-1 linear streaming W once (fp32 / bf16 / int8 weights)",
        py::arg("x"), py::arg("w"), py::arg("scale") = py::none(), py::arg("bias") = py::none());
  m.def("gemv_w8a8", &gemv_w8a8, "1-8-row linear with int8 weights and x quantized to int8 (integer dot)",
        py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("bias") = py::none(), py::arg("xblock") = 32);
  m.def("has_avx2", &has_avx2);
}
