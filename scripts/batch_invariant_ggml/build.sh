#!/usr/bin/env bash
# Builds the ggml-cpu library of the llama-cpp-python that .venv has, from its own source package, with
# q4_K_gemm_per_super_block.patch applied, into a folder holding the binding's libraries with that one
# replaced. LLAMA_CPP_LIB_PATH=<folder> makes llama-cpp-python load it (an experiment of issue 50; nothing
# in specd uses it yet). Needs PyPI, cmake and a C++ compiler; about a minute on 2 cores.
#
#   scripts/batch_invariant_ggml/build.sh [folder]        (default /tmp/specd-ggml-batch-invariant)
#   GGML_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON" build.sh DIR
#                      (the AVX2 kernels, as a CPU without AVX-512 runs them; they run here too)
#   NO_PATCH=1 build.sh DIR   (the same build without the patch: what the check compares against)
#
# The patch: ggml's x86 gemm for repacked Q4_K weights (ggml_gemm_q4_K_8x8_q8_K: 16 rows at a time, then
# 4; AVX-512, and AVX2 for CPUs without it and for columns past a multiple of 16) adds each 64-value step
# of a super-block into its float sum as it goes; the gemv (ggml_gemv_q4_K_8x8_q8_K, one row) adds the
# super-block's integer sum once. So a row's logits depend on whether it ran alone or beside others.
# With the patch all four paths sum the super-block in integers and add it once, as the gemv does: bit
# for bit the gemv's result, whatever the rows beside it (check_gemm.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-/tmp/specd-ggml-batch-invariant}
version=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))')
lib=$(.venv/bin/python -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("llama_cpp").origin).parent / "lib")')
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "building ggml-cpu of llama-cpp-python $version with the patch (in $work)"
.venv/bin/pip download "llama-cpp-python==$version" --no-binary :all: --no-deps -d "$work" -q 2>/dev/null
tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
[ -n "${NO_PATCH:-}" ] || patch -d "$src" -p1 <scripts/batch_invariant_ggml/q4_K_gemm_per_super_block.patch
# shellcheck disable=SC2086  # GGML_FLAGS: several cmake flags, split on spaces
cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON ${GGML_FLAGS:-} -DBUILD_SHARED_LIBS=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DLLAMA_CURL=OFF -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH='$ORIGIN' >"$work/cmake.log" 2>&1 ||
  { tail -30 "$work/cmake.log"; exit 1; }
cmake --build "$src/build" --target ggml-cpu -j "$(nproc)" >>"$work/cmake.log" 2>&1 || { tail -30 "$work/cmake.log"; exit 1; }
mkdir -p "$out"
cp -a "$lib"/. "$out"/
for file in "$out"/libggml-cpu.so*; do
  rm -f "$file"
  cp -L "$src/build/bin/libggml-cpu.so" "$file"
done
echo "LLAMA_CPP_LIB_PATH=$out"
