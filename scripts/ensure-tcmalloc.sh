#!/usr/bin/env bash
# Makes sure tcmalloc is installed for the benchmarks' vLLM peer: vLLM's CPU docs ask for it in
# LD_PRELOAD (benchmarks/backends.py preloads it), and a peer run without it is not run as its
# docs recommend. Installs Debian's libtcmalloc-minimal4 (scripts/apt-install.sh: as root, or
# through sudo when sudo asks no password); otherwise says how. Nothing to do when it is there.
set -euo pipefail
if ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so* >/dev/null 2>&1; then
  exit 0
fi
echo "installing tcmalloc (Debian package libtcmalloc-minimal4)" >&2
if "$(dirname "$0")/apt-install.sh" libtcmalloc-minimal4; then
  exit 0
fi
echo "tcmalloc is missing. Install it (sudo apt-get install libtcmalloc-minimal4)." >&2
exit 1
