# Sourced by scripts/vllm-env.sh and scripts/openvino-env.sh, with venv, stamp, want and label
# set: exits at once when $stamp says the env was made for $want; else creates the venv
# (Python 3.11, kept out of git) and defines $py and pip. The caller writes $want to $stamp
# once everything is installed.
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "$venv is ready ($label)"
  exit 0
fi
SECONDS=0

if [ ! -x "$venv/bin/python" ]; then
  python3.11 -m venv "$venv"
fi
echo '*' > "$venv/.gitignore"  # gigabytes that git must never pick up (the repo's .gitignore names .venv/ only)
py=$venv/bin/python
pip() {  # quiet, less the machine's warnings about local index folders it lacks
  "$py" -m pip "$@" --quiet --disable-pip-version-check 2> >(grep -v 'is ignored: it is neither' >&2)
}
