#!/usr/bin/env bash
# Makes sure tcmalloc is installed for the benchmarks' vLLM peer: vLLM's CPU docs ask for it in
# LD_PRELOAD (benchmarks/backends.py preloads it), and a peer run without it is not run as its
# docs recommend. Installs Debian's libtcmalloc-minimal4 as root, or through sudo when sudo asks
# no password; otherwise says how. Nothing to do when it is already there.
set -euo pipefail
if ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so* >/dev/null 2>&1; then
  exit 0
fi
if command -v apt-get >/dev/null 2>&1; then
  as_root=""
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root="sudo"
  fi
  if [ "$(id -u)" = 0 ] || [ -n "$as_root" ]; then
    echo "installing tcmalloc (Debian package libtcmalloc-minimal4)" >&2
    $as_root apt-get update -qq
    $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null
    exit 0
  fi
fi
echo "tcmalloc is missing. Install it (sudo apt-get install libtcmalloc-minimal4)." >&2
exit 1
