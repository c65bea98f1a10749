#!/usr/bin/env bash
# Creates a separate virtualenv with OpenVINO GenAI and optimum-intel, for benchmarks/engine.py's
# `openvino` mode (a peer engine measured beside streamq's); safe to run again (a stamp makes a
# finished env return at once). Not needed by the tests.
# Usage: scripts/openvino-env.sh [VENV]   (default .venv-openvino)
set -euo pipefail
venv=${1:-.venv-openvino}
TORCH=torch==2.13.0  # resolves to the local 2.13.0+cpu wheel; unpinned, pip would take a CUDA build

stamp=$venv/.openvino-installed
want=$(sha256sum "$0" | cut -d' ' -f1)  # redo the installs when this script changes
label="OpenVINO GenAI"
source "$(dirname "$0")/side-venv.sh"

pip install openvino-genai "optimum-intel[openvino]" "$TORCH"
# A CUDA torchvision comes along and breaks transformers' import; text models need none.
pip uninstall --yes torchvision torchaudio

"$py" -c 'import openvino, openvino_genai, optimum.intel, torch, transformers
print(f"openvino {openvino.__version__}, openvino_genai {openvino_genai.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}")'
echo "$want" > "$stamp"
echo "$venv ready in ${SECONDS} s"
