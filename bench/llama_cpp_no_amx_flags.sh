#!/usr/bin/env bash
# Prints the CMake flags that build llama.cpp for this x86 CPU's instruction sets (as GGML_NATIVE would), but
# without its AMX kernels. Why: llama.cpp as vendored by llama-cpp-python 0.3.36 crashes on an AMX Xeon the
# first time its AMX Q8_0/Q4_0 matmul runs (a general protection fault at `ldtilecfg` in
# ggml_backend_amx_mul_mat: the compiler drops the stores that fill the tile configuration, so an invalid one
# is loaded; llama.cpp pull request 26954 describes it). A user of this CPU has to build without AMX to run
# llama.cpp's quantized types at all, so that build is the peer here; its Q8_0/Q4_0 products run on AVX-512 VNNI.
# Used by bench/build_llama_cpp_no_amx.sh and (LLAMA_CMAKE_CPU=...) bench/build_batched_bench.sh.
#
# With --avx2: the flags an AVX2-only CPU (AMD EPYC Zen 2/3: AVX2, FMA, F16C, BMI2, no AVX-512, no AVX-VNNI)
# would build with, whatever this CPU has: the peer for sluice's AVX2 build (SLUICE_KERNEL_FLAGS=-mno-avx512f) on
# an AVX-512 machine, both on the same memory (docs/benchmarks.md, "AVX2 builds on an AVX-512 host").
set -euo pipefail
flags=$(grep -m1 '^flags' /proc/cpuinfo)
if [[ ${1:-} == --avx2 ]]; then
  flags="flags : avx avx2 fma f16c bmi2"
fi
has() { [[ " $flags " == *" $1 "* ]]; }
out="-DGGML_NATIVE=OFF"
for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
            avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
  if has "${pair%%:*}"; then out="$out -DGGML_${pair#*:}=ON"; else out="$out -DGGML_${pair#*:}=OFF"; fi
done
echo "$out -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
