#!/usr/bin/env bash
# Makes sure a headless browser and its WebDriver are installed (the playground's end-to-end test,
# tests/e2e/test_playground.py, drives Debian's chromium through chromedriver): installs Debian's
# packages as root, or through sudo when sudo asks no password; otherwise says how. Nothing to do
# when both are already there.
set -euo pipefail
have() { command -v "$1" >/dev/null 2>&1; }
if { have chromium || have chromium-browser || have google-chrome; } && have chromedriver; then
  exit 0
fi
if have apt-get; then
  as_root=""
  if [ "$(id -u)" != 0 ] && have sudo && sudo -n true 2>/dev/null; then
    as_root="sudo"
  fi
  if [ "$(id -u)" = 0 ] || [ -n "$as_root" ]; then
    echo "installing chromium and chromium-driver (Debian packages)"
    $as_root apt-get update -qq
    $as_root env DEBIAN_FRONTEND=noninteractive DEBCONF_NOWARNINGS=yes apt-get install -y -qq --no-install-recommends \
      chromium chromium-driver >/dev/null
    exit 0
  fi
fi
echo "chromium and chromedriver are missing (the playground test needs them)." \
  "Install them (sudo apt-get install chromium chromium-driver, or your system's packages)" \
  "and make sure both are on PATH." >&2
exit 1
