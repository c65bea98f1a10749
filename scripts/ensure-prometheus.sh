#!/usr/bin/env bash
# Makes sure Prometheus and promtool are installed (tests/e2e/test_dashboard.py runs its own
# prometheus against a running stack; tests/unit/test_monitoring.py runs promtool on
# deploy/prometheus): installs Debian's package, its service kept from starting (it would take port
# 9090 and scrape this machine; the tests run their own, on a free port, with their config).
# Nothing to do when both are already there.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  exit 0
fi
echo "installing prometheus (Debian package; its service is not started)"
# No recommends: they would bring prometheus-node-exporter, another service.
if "$(dirname "$0")/apt-install.sh" --no-start prometheus; then
  exit 0
fi
echo "prometheus and promtool are missing (the dashboard and alert tests need them)." \
  "Install them (sudo apt-get install --no-install-recommends prometheus, or Prometheus's release" \
  "tarball) and make sure both are on PATH." >&2
exit 1
