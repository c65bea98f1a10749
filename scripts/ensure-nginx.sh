#!/usr/bin/env bash
# Makes sure nginx is installed (the load balancer of `streamq serve --api-replicas N`, and what
# the tests check deploy/nginx.conf with): installs Debian's package as root, or through sudo when
# sudo asks no password; otherwise says how. Nothing to do when it is already there.
set -euo pipefail
# Debian installs it in /usr/sbin, which is not on an ordinary user's PATH.
if command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; then
  exit 0
fi
if command -v apt-get >/dev/null 2>&1; then
  as_root=""
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root="sudo"
  fi
  if [ "$(id -u)" = 0 ] || [ -n "$as_root" ]; then
    echo "installing nginx (Debian package)"
    $as_root apt-get update -qq
    # nginx-light where the release has it (Debian 12), else the plain package.
    $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light >/dev/null 2>&1 \
      || $as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null
    exit 0
  fi
fi
echo "nginx is missing. Install it (sudo apt-get install nginx-light, or your system's nginx package)." >&2
exit 1
