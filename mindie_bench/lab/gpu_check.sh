#!/usr/bin/env bash
# GPU check, for a machine with one CUDA device: the CUDA tests, then decode figures.
#
#   mindie_bench/lab/gpu_check.sh [OUT_DIR]      (or: mindie-bench gpu-check [OUT_DIR])
#
# 1. The tests that need CUDA (pytest -k cuda: the model on CUDA against transformers, the
#    engine's greedy tokens on CUDA against the CPU's) - they are skipped on machines without one.
# 2. mindie_bench/lab/roofline.py --device cuda on a ~1B random Llama (demo preset gpu1b: Llama-3.2-1B's
#    shape, bf16, tensor parallel 1) at batch 1 and 64: tokens/s next to the HBM read-bandwidth
#    roofline (measured with a torch.sum over 4 GiB of device memory) and the fraction.
# Everything is printed and kept in OUT_DIR (default ./gpu-check-<date>); record the table in
# docs/performance.md. Needs: an installed checkout (pip install -e '.[test]') and a CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${1:-gpu-check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
"$PY" - <<'PYEOF'
import torch
if not torch.cuda.is_available():
    raise SystemExit("gpu_check.sh: torch sees no CUDA device (torch %s)" % torch.__version__)
print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
PYEOF
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv 2>/dev/null | tee "$OUT/nvidia-smi.csv" || true
echo "== CUDA tests" >&2
"$PY" -m pytest -q -p no:cacheprovider -k cuda tests/ 2>&1 | tee "$OUT/tests.txt"
echo "== decode roofline (gpu1b, bf16, batch 1 and 64)" >&2
"$PY" -m mindie_bench.lab.roofline --device cuda --preset gpu1b --dtype bfloat16 --concurrency 1,64 \
    --context 512 --steps 64 --warm 8 --repeat 3 --bw-mib 4096 --block-size 128 \
    --json "$OUT/roofline.json" | tee "$OUT/roofline.txt"
echo "gpu_check.sh: results in $OUT" >&2
