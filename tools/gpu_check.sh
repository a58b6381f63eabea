#!/usr/bin/env bash
# kvxfer's GPU checks in ONE run on a GPU machine that can download nothing (docs/gpu.md).
#
#   cp -r ../shared/gpu-kit .whl          # here: the wheels (git-ignored, ~19 MiB), then on the GPU machine:
#   bash tools/gpu_check.sh               # from the checkout root, about 8 minutes
#
# The project's own checks run first (they are what a user with a GPU runs too): `kvxfer info` (which UCX
# lanes a VRAM pool takes), every test marked `gpu` (tests/backends/test_vram_xproc.py: two processes, VRAM to VRAM,
# nixl and ucx, scattered and contiguous ids, staged TP 2->1, a killed source), and `kvxfer bench --device
# cuda` (VRAM pulls against the GPU's own device-to-device copy). Then the kit's whole-pool timings
# (.whl/gpu_xproc.py: 1 GiB pools) and NCCL on one GPU. Each step has its own timeout, the run a deadline
# (DEADLINE s); a failed step is logged and the next one runs. Results in $OUT (default ./gpu-out):
# gpu_check.log (this output), steps.log (every step's log), results.jsonl, bench.json.
set -u
OUT=${OUT:-$PWD/gpu-out}; STEPS=/tmp/kvxfer-gpu-steps; KIT=${KIT:-.whl}; DEADLINE=${DEADLINE:-440}
mkdir -p "$OUT" "$STEPS"
export PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=WARN

step() {  # step NAME MAX_S CMD...: capped by what is left of the deadline, skipped under 20 s
  local name=$1 max=$2; shift 2
  local left=$((DEADLINE - SECONDS)); ((left < max)) && max=$left
  if ((max < 20)); then echo "=== SKIP $name (deadline)"; return; fi
  echo "=== $name (limit ${max}s, t=${SECONDS}s)"
  timeout -k 5 "$max" "$@" > "$STEPS/$name.log" 2>&1; local rc=$?
  grep -h '^RESULT ' "$STEPS/$name.log" >> "$OUT/results.jsonl"
  tail -n 25 "$STEPS/$name.log" | cut -c1-400; echo "=== $name rc=$rc t=${SECONDS}s"
}

install_kit() {  # the kit's wheels into /tmp/site; the ucx binding prebuilt, or built here
  timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$KIT"/*.whl \
    || { echo "WHEEL INSTALL FAILED"; return 1; }
  export PYTHONPATH=/tmp/site:$PWD
  cp "$KIT"/_ucp_cffi.cpython-312-x86_64-linux-gnu.so kvxfer/backends/ucx/ 2>/dev/null
  local check='import kvxfer.backends.ucx.binding as b; b.load(); print("ucx binding OK, UCX", b.version())'
  if ! timeout 60 python3 -c "$check"; then
    rm -f kvxfer/backends/ucx/_ucp_cffi.*.so
    timeout 90 python3 kvxfer/backends/ucx/binding_build.py && python3 -c "$check"
  fi
}

main() {
  nvidia-smi -L
  python3 -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available(), "nccl", torch.cuda.nccl.version())'
  install_kit || return
  step info 60 python3 -m kvxfer info
  local pt="python3 -m pytest -q -rA -m gpu -p no:cacheprovider --timeout 150"
  step pytest_vram_xproc 200 $pt tests/backends/test_vram_xproc.py
  step pytest_gpu_rest 150 $pt tests/unit/test_geometry.py tests/backends/test_local_backend.py tests/backends/test_nixl_backend.py \
    tests/backends/test_ucx_backend.py tests/backends/test_nccl_backend.py tests/cli/test_bench.py
  step bench_cuda 120 python3 -m kvxfer bench --device cuda --backends nixl,ucx --sizes 256K,1M --blocks 64 \
    --reshard off --repeats 5 --max-request-mib 128 --json "$OUT/bench.json"
  local x="python3 $KIT/gpu_xproc.py"
  step xproc_nixl 80 env UCX_PROTO_INFO=y $x pull --backend nixl
  step xproc_ucx 80 env UCX_PROTO_INFO=y $x pull --backend ucx
  step nccl_1gpu 100 env NCCL_SOCKET_IFNAME=lo GLOO_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 $x nccl1 --names matched,tp2to1
  echo "=== UCX_PROTO_INFO lines naming a CUDA transport:"
  grep -h -i -E 'cuda_ipc|cuda_copy' "$STEPS"/xproc_*.log | sed 's/^\[[^]]*\] *\[[^]]*\] *//' | sort | uniq -c | sort -rn | head -12 | cut -c1-300
  echo "=== summary"
  python3 - "$OUT/results.jsonl" <<'EOF'
import json, sys
keys = ("backend", "sources", "paths", "bytes_ok", "bytes_ok_after_timing", "read_done", "ucx_lanes", "pull_seq_GBps",
        "pull_perm_GBps", "memcpy_d2d_GBps", "index_copy_GBps", "matched", "tp2to1")
for line in open(sys.argv[1]):
    r = json.loads(line[len("RESULT "):])
    print({k: r[k] for k in keys if k in r}, ("EXCEPTION " + r["exception"][-300:]) if "exception" in r else "")
EOF
}

set -o pipefail
main 2>&1 | tee "$OUT/gpu_check.log"
for f in "$STEPS"/*.log; do echo "##### $f"; tail -c 300000 "$f"; done > "$OUT/steps.log"
echo "total ${SECONDS}s"
