#!/usr/bin/env bash
# Makes sure redis-server is installed: installs Debian's package as root, or through sudo when
# sudo asks no password; otherwise says how. Nothing to do when it is already there.
set -euo pipefail
command -v redis-server >/dev/null 2>&1 && exit 0
as_root=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  as_root="sudo"
fi
if { [ "$(id -u)" = 0 ] || [ -n "$as_root" ]; } && command -v apt-get >/dev/null 2>&1; then
  echo "installing redis-server (Debian package)"
  $as_root apt-get update -qq && $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  exit 0
fi
echo "redis-server is missing. Install it (sudo apt-get install redis-server) or set REDIS_URL to a Redis you run." >&2
exit 1
