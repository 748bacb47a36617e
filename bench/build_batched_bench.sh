#!/usr/bin/env bash
# Builds llama.cpp's own batched-decode benchmark, llama-batched-bench, the peer of
# bench/batch_decode.py, from the llama.cpp that llama-cpp-python's source distribution vendors
# (so the batch-1 peer of `sluice bench --vs llama.cpp` and this one are the same llama.cpp).
#
# Usage (from the repository root): bash bench/build_batched_bench.sh [LLAMA_CPP_SRC] [BUILD_DIR]
#   LLAMA_CPP_SRC  default: the newest .peers/sdist/llama_cpp_python-*/vendor/llama.cpp
#                  (unpacked by ../shared/peers/build-llama-cpp.sh)
#   BUILD_DIR      default: .peers/lcpp-tools; the binary lands in BUILD_DIR/bin/llama-batched-bench
# A few minutes on 2 cores; only that one target is built, and a rebuild is incremental.
set -euo pipefail
SRC=${1:-}
if [[ -z $SRC ]]; then
  SRC=$(ls -d .peers/sdist/llama_cpp_python-*/vendor/llama.cpp 2>/dev/null | sort -V | tail -n 1 || true)
fi
if [[ -z $SRC || ! -f $SRC/CMakeLists.txt ]]; then
  echo "build_batched_bench.sh: no llama.cpp source at '${SRC:-.peers/sdist/llama_cpp_python-*/vendor/llama.cpp}';" \
       "unpack llama-cpp-python's sdist first (bash ../shared/peers/build-llama-cpp.sh .peers) or pass its" \
       "vendor/llama.cpp folder" >&2
  exit 2
fi
BUILD=${2:-.peers/lcpp-tools}
JOBS=${JOBS:-2}
# GGML_NATIVE: every instruction set this CPU has, as llama-cpp-python's own build uses; on an AMX Xeon,
# LLAMA_CMAKE_CPU="$(bash bench/llama_cpp_no_amx_flags.sh)" builds without the AMX kernels (that script says why). Static
# libraries, so the binary runs without the build tree's shared objects on its library path. No
# tests, no server, no HTTPS (nothing here downloads a model).
nice -n 10 cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release ${LLAMA_CMAKE_CPU:--DGGML_NATIVE=ON} \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
nice -n 10 cmake --build "$BUILD" --target llama-batched-bench -j "$JOBS"
"$BUILD/bin/llama-batched-bench" --version 2>&1 | head -n 2 || true
echo "built $BUILD/bin/llama-batched-bench"
