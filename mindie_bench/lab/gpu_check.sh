#!/usr/bin/env bash
# GPU check, for a machine with one CUDA device: the CUDA tests, then decode figures.
#
#   mindie_bench/lab/gpu_check.sh [OUT_DIR]      (or: mindie-bench gpu-check [OUT_DIR])
#
# 1. The tests that need CUDA, in the process (tests/test_cuda.py, tests/test_models.py -k cuda: the
#    model on CUDA against the CPU in fp32 and bf16, the engine's greedy tokens on CUDA against the CPU's).
# 2. mindie_bench/lab/roofline.py --device cuda on a ~1B random Llama (demo preset gpu1b: Llama-3.2-1B's
#    shape, bf16, tensor parallel 1) at batch 1 and 64: tokens/s next to the HBM read-bandwidth
#    roofline (measured with a torch.sum over 4 GiB of device memory) and the fraction.
# 3. The served check: the launch script with deviceType cuda (supervisor, worker on GPU 0, gunicorn,
#    ZeroMQ) answers /infer_token, whole and streamed, with a CPU server's greedy tokens.
# Each step has its own time limit and a failed step does not stop the next; the exit status is
# the number of failed steps. Everything is printed and kept in OUT_DIR (default
# ./gpu-check-<date>); record the table in docs/performance.md. Needs: an installed checkout
# (pip install -e '.[test]') and a CUDA torch. It runs in about 5 minutes on an H200.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${1:-gpu-check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
failed=0
step() {  # step NAME LIMIT_S CMD...: run it with output kept in $OUT/NAME.txt
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit} s)" >&2
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - t0)) s" >&2
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
}
"$PY" - <<'PYEOF' || exit 1
import torch
if not torch.cuda.is_available():
    raise SystemExit("gpu_check.sh: torch sees no CUDA device (torch %s)" % torch.__version__)
print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
PYEOF
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory,driver_version --format=csv 2>/dev/null \
    | tee "$OUT/nvidia-smi.csv" || true
step tests 150 "$PY" -m pytest -q -p no:cacheprovider --timeout 140 -k "cuda and not served" \
    tests/test_cuda.py tests/test_models.py
step roofline 180 "$PY" -m mindie_bench.lab.roofline --device cuda --preset gpu1b --dtype bfloat16 \
    --concurrency 1,64 --context 512 --steps 64 --warm 8 --repeat 3 --bw-mib 4096 --block-size 128 \
    --json "$OUT/roofline.json"
step served 180 "$PY" -m pytest -q -p no:cacheprovider --timeout 170 -k served tests/test_cuda.py
echo "gpu_check.sh: results in $OUT ($failed failed steps)" >&2
exit "$failed"
