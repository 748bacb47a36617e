// sluice's decode linear: y = x W^T (+ b) for 1-8 rows of x, streaming W once.
//
// At decode time x has 1..8 rows and W is read from DRAM once per token, so the product is a
// memory stream, not arithmetic. This kernel walks W row by row (each output is one dot product
// of a W row with every x row), splits the rows across torch's intra-op threads, and widens bf16
// (a 16-bit shift) or int8 (with a per-row scale) to fp32 in registers, so W is read at its
// stored width and never copied. Accumulation is fp32. Built once per machine by gemv.py with
// -march=native: AVX2 + FMA intrinsics where the compiler has them, a plain loop otherwise.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SLUICE_AVX2 1
#endif

namespace {

constexpr int kMaxRows = 8;

// Widen 8 stored weights to fp32.
#ifdef SLUICE_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const int8_t* p) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) { return static_cast<float>(v); }
inline float widen(int8_t v) { return static_cast<float>(v); }

// out[m] = dot(w[0:K], x[m, 0:K]) for m < M; x is fp32 (M, K) contiguous. Two accumulators per x
// row hide the FMA latency. (Walking 2-4 W rows at once, with software prefetch, measured slower
// on the AVX2 EPYC: docs/benchmarks.md, "Fast decode".)
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

bool has_avx2() {
#ifdef SLUICE_AVX2
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "batch-1 linear streaming W once (fp32 / bf16 / int8 weights)",
        py::arg("x"), py::arg("w"), py::arg("scale") = py::none(), py::arg("bias") = py::none());
  m.def("has_avx2", &has_avx2);
}
