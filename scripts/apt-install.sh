#!/usr/bin/env bash
# Installs Debian packages (without their recommends) as root, or through sudo when sudo asks no
# password: `scripts/apt-install.sh [--no-start] PACKAGE...`. Exits 1 having done nothing where it
# can do neither (or there is no apt-get): the caller then says how to install them by hand.
#
# --no-start: the packages' services do not start, now or at boot. The install runs under a
# policy-rc.d that refuses every start (unless the machine has one already, as Docker images do),
# and on a systemd machine each package's unit of the same name is disabled and stopped.
set -euo pipefail
have() { command -v "$1" >/dev/null 2>&1; }
no_start=""
if [ "${1:-}" = --no-start ]; then
  no_start=1
  shift
fi
have apt-get || exit 1
as_root=""
if [ "$(id -u)" != 0 ]; then
  { have sudo && sudo -n true 2>/dev/null; } || exit 1
  as_root="sudo"
fi
policy=/usr/sbin/policy-rc.d
placed=""
if [ -n "$no_start" ] && [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $as_root tee "$policy" >/dev/null
  $as_root chmod 755 "$policy"
  placed=1
fi
status=0
$as_root apt-get update -qq || status=$?
if [ "$status" = 0 ]; then
  $as_root env DEBIAN_FRONTEND=noninteractive DEBCONF_NOWARNINGS=yes apt-get install -y -qq \
    --no-install-recommends "$@" >/dev/null || status=$?
fi
if [ -n "$placed" ]; then
  $as_root rm -f "$policy"
fi
if [ -n "$no_start" ] && [ -d /run/systemd/system ]; then
  for package in "$@"; do
    $as_root systemctl disable --now "$package" >/dev/null 2>&1 || true
  done
fi
exit "$status"
