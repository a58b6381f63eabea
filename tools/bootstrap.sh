#!/usr/bin/env bash
# Create the virtual environment kvxfer's commands run in, and install kvxfer into it.
# torch goes first and pinned: asking pip for plain `torch` (or for `nixl`, which depends
# on it) on a machine without torch pulls a multi-GB CUDA build; 2.13.0 is the CPU build
# on CPU-only machines here and a CUDA build where PyPI serves that.
set -euo pipefail
venv=${1:-.venv}
cd "$(dirname "$0")/.."
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check "torch==2.13.0"
"$venv/bin/pip" install --quiet --disable-pip-version-check -e ".[nixl,bench,test,etcd]"
echo "kvxfer installed in $venv"
