#!/usr/bin/env bash
# Builds llama-cpp-python from the same source distribution as ../shared/peers/build-llama-cpp.sh, for this
# CPU's instruction sets but without llama.cpp's AMX kernels (bench/llama_cpp_no_amx_flags.sh says why), into
# a venv of its own. Run from the repository root after build-llama-cpp.sh has fetched the sdist:
#   bash bench/build_llama_cpp_no_amx.sh [WORKDIR]     (default .peers; venv WORKDIR/lcpp-noamx-venv)
# then pass --llama-python WORKDIR/lcpp-noamx-venv/bin/python to `sluice bench`. 5-10 minutes on 2 cores.
#   bash bench/build_llama_cpp_no_amx.sh --avx2 [WORKDIR]   builds as an AVX2-only CPU would (venv
#   WORKDIR/lcpp-avx2-venv; llama_cpp_no_amx_flags.sh --avx2), the peer of sluice's AVX2 kernels on an AVX-512 host.
set -euo pipefail
ISA=native
if [[ ${1:-} == --avx2 ]]; then ISA=avx2; shift; fi
WORK=${1:-.peers}
NAME=$([[ $ISA == avx2 ]] && echo lcpp-avx2 || echo lcpp-noamx)
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
tarball="$WORK/sdist/llama_cpp_python-$VERSION.tar.gz"
[[ -f $tarball ]] || { echo "build_llama_cpp_no_amx.sh: no $tarball; run ../shared/peers/build-llama-cpp.sh first" >&2; exit 2; }
[[ -x $WORK/$NAME-venv/bin/python ]] || python3 -m venv "$WORK/$NAME-venv"
FLAGS=$(bash "$(dirname "$0")/llama_cpp_no_amx_flags.sh" $([[ $ISA == avx2 ]] && echo --avx2))
echo "build_llama_cpp_no_amx.sh: $FLAGS"
CMAKE_ARGS="$FLAGS -DLLAVA_BUILD=OFF -DCMAKE_BUILD_TYPE=Release" CMAKE_BUILD_PARALLEL_LEVEL=2 \
  nice -n 10 "$WORK/$NAME-venv/bin/pip" install --no-cache-dir --config-settings=build-dir="$WORK/$NAME-build" "$tarball"
"$WORK/$NAME-venv/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, 'built without AMX ($ISA)')"
