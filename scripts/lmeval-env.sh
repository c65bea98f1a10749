#!/usr/bin/env bash
# Creates a separate virtualenv with EleutherAI's lm-evaluation-harness (pinned), for
# tests/e2e/test_lm_eval.py: lm-eval's local-completions against the running stack, and its hf
# backend on the same weights. Its own env: datasets, evaluate and their dependencies stay out of
# the product's. Safe to run again (a stamp makes a finished env return at once).
# Usage: scripts/lmeval-env.sh [VENV]   (default .venv-lmeval)
set -euo pipefail
venv=${1:-.venv-lmeval}
LMEVAL="lm-eval[api,hf]==0.4.13"
TORCH=torch==2.13.0  # resolves to the local 2.13.0+cpu wheel; unpinned, pip would take a CUDA build

stamp=$venv/.lmeval-installed
want=$(cat "$0" pyproject.toml | sha256sum | cut -d' ' -f1)  # pyproject pins the transformers it takes
label="$LMEVAL"
source "$(dirname "$0")/side-venv.sh"

transformers=$(.venv/bin/python -c 'import transformers; print(transformers.__version__)' 2>/dev/null || echo 5.25.0)
pip install "$TORCH"
pip install "$LMEVAL" "transformers==$transformers" "$TORCH"
"$py" -c 'import lm_eval, torch, transformers
print(f"lm-eval {lm_eval.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")'
echo "$want" > "$stamp"
echo "$venv ready in ${SECONDS} s"
