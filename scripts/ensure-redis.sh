#!/usr/bin/env bash
# Makes sure redis-server is installed: installs Debian's package when run as root,
# otherwise says how. Nothing to do when it is already there.
set -euo pipefail
command -v redis-server >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing redis-server (Debian package)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  exit 0
fi
echo "redis-server is missing. Install it (sudo apt-get install redis-server) or set REDIS_URL to a Redis you run." >&2
exit 1
