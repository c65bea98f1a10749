#!/usr/bin/env bash
# Builds llama.cpp's own binaries (llama-server, llama-perplexity, llama-bench, llama-quantize) for
# the peer benchmarks and scripts/real_gguf.py, from the llama.cpp source that the llama-cpp-python
# sdist on PyPI carries, for this CPU (GGML_NATIVE), into a cache folder; prints the folder. Safe to
# run again.
# Usage: scripts/llama-cpp.sh [VERSION]   (cache: $STREAMQ_PEERS_DIR, default ~/.cache/streamq/peers)
set -euo pipefail
version=${1:-0.3.36}
root=${STREAMQ_PEERS_DIR:-$HOME/.cache/streamq/peers}
out="$root/llama.cpp-$version"
if [ -x "$out/bin/llama-server" ] && [ -x "$out/bin/llama-perplexity" ] && [ -x "$out/bin/llama-quantize" ]; then
  echo "$out"; exit 0
fi
mkdir -p "$root"
work=$(mktemp -d "$root/build.XXXXXX")
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
  "llama-cpp-python==$version" -d "$work" >&2
tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
src=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$work/build" -j "$(nproc)" --target llama-server llama-perplexity llama-bench llama-quantize >&2
mkdir -p "$out.partial/bin"
cp "$work"/build/bin/llama-server "$work"/build/bin/llama-perplexity "$work"/build/bin/llama-bench \
  "$work"/build/bin/llama-quantize "$out.partial/bin/"
rm -rf "$out" && mv "$out.partial" "$out"
echo "$out"
