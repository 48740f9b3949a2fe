#!/usr/bin/env bash
# Builds the ggml-cpu library of the llama-cpp-python that .venv has, from its own source package, with
# this folder's patches applied (issue 50), and installs it or assembles a folder with it.
#
#   scripts/batch_invariant_ggml/build.sh --install   (scripts/setup.sh runs this) writes it over the
#       binding's own libggml-cpu in .venv; built once per llama-cpp-python version, patch set and CPU
#       into $SPECD_CACHE/lib (default ~/.cache/specd/lib), so a re-run or a fresh .venv copies it
#   scripts/batch_invariant_ggml/build.sh [folder]    (default /tmp/specd-ggml-batch-invariant) the
#       binding's libraries with that one replaced, for LLAMA_CPP_LIB_PATH=<folder> (experiments)
#   GGML_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON" build.sh DIR
#                      (the AVX2 kernels, as a CPU without AVX-512 runs them; they run here too)
#   NO_PATCH=1 build.sh DIR   (the same build without the patches: what check_gemm.py compares against)
# Needs PyPI, a C++ compiler and cmake (PyPI's cmake into .venv where there is none); ~1 min on 2 cores.
#
# q4_K_gemm_per_super_block.patch: ggml's x86 gemm for repacked Q4_K weights (ggml_gemm_q4_K_8x8_q8_K:
# 16 rows at a time, then 4; AVX-512, and AVX2 for CPUs without it and for columns past a multiple of 16)
# adds each 64-value step of a super-block into its float sum as it goes; the gemv (ggml_gemv_q4_K_8x8_q8_K,
# one row) adds the super-block's integer sum once. So a row's logits depend on whether it ran alone or
# beside others. With the patch all four paths sum the super-block in integers and add it once, as the
# gemv does: bit for bit the gemv's result, whatever the rows beside it (check_gemm.py).
# tiled_min_rows.patch: GGML_CPU_TILED_MM_MIN_ROWS, the fewest rows of a call that take ggml's tiled
# matmul (8 unpatched). The weights x86 does not repack (Q6_K) take it, and it rounds otherwise than the
# one-row vec_dot; the llama.cpp engine sets it above its scored calls (model/llama_cpp_engine.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
here=scripts/batch_invariant_ggml
install=
if [ "${1:-}" = --install ]; then
  install=1
  out=
else
  out=${1:-/tmp/specd-ggml-batch-invariant}
fi
version=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))')
lib=$(.venv/bin/python -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("llama_cpp").origin).parent / "lib")')
patches=("$here"/*.patch)
[ -z "${NO_PATCH:-}" ] || patches=()
# what the build depends on: the version, the patches, the flags and (native build) this CPU's flags
key=$( (
  echo "$version ${GGML_FLAGS:-}"
  cat "${patches[@]}" /dev/null
  grep -m1 '^flags' /proc/cpuinfo || true
) | sha256sum | cut -c1-16)
built=${SPECD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/specd}/lib/libggml-cpu-$version-$key.so

if [ ! -f "$built" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  cmake=$(command -v cmake || true)
  if [ -z "$cmake" ]; then
    .venv/bin/python -m pip install --quiet cmake
    cmake=.venv/bin/cmake
  fi
  echo "building ggml-cpu of llama-cpp-python $version with ${#patches[@]} patches (in $work)"
  .venv/bin/python -m pip download "llama-cpp-python==$version" --no-binary :all: --no-deps -d "$work" -q
  tar xzf "$work/llama_cpp_python-$version.tar.gz" -C "$work"
  src="$work/llama_cpp_python-$version/vendor/llama.cpp"
  for file in "${patches[@]}"; do
    patch -d "$src" -p1 --quiet <"$file"
  done
  # shellcheck disable=SC2086  # GGML_FLAGS: several cmake flags, split on spaces
  "$cmake" -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON ${GGML_FLAGS:-} -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DLLAMA_CURL=OFF -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH='$ORIGIN' >"$work/cmake.log" 2>&1 ||
    { tail -30 "$work/cmake.log"; exit 1; }
  "$cmake" --build "$src/build" --target ggml-cpu -j "$(nproc)" >>"$work/cmake.log" 2>&1 || { tail -30 "$work/cmake.log"; exit 1; }
  mkdir -p "$(dirname "$built")"
  cp -L "$src/build/bin/libggml-cpu.so" "$built.partial"
  mv "$built.partial" "$built"
fi

if [ -n "$install" ]; then
  target=$lib
else
  mkdir -p "$out"
  cp -a "$lib"/. "$out"/
  target=$out
fi
# the binding's lib folder holds libggml-cpu.so, .so.0 and .so.0.x.y as copies (a wheel keeps no links)
for file in "$target"/libggml-cpu.so*; do
  if ! cmp -s "$built" "$file"; then
    cp "$built" "$file.partial"
    mv -f "$file.partial" "$file"
  fi
done
if [ -n "$install" ]; then
  echo "ggml-cpu with ${#patches[@]} patches ($here) installed in $lib"
else
  echo "LLAMA_CPP_LIB_PATH=$out"
fi
