# Shared by the side-by-side scripts (vllm_side_by_side.sh, llama_server_side_by_side.sh); sourced,
# not run. Expects PY (the interpreter), CONC, NUM_PROMPTS, EXTRA and BENCH_ARGS from its caller,
# and a die function.

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

# BENCH (the mindie-bench command), LEVELS and COUNTS (--concurrency and --num-prompts split).
bench_setup() {
    if [[ -n "${MINDIE_BENCH:-}" ]]; then
        read -r -a BENCH <<<"$MINDIE_BENCH"
    else
        BENCH=("$PY" -m mindie_bench)  # this checkout's (PYTHONPATH), not another install's
    fi
    IFS=, read -r -a LEVELS <<<"$CONC"
    IFS=, read -r -a COUNTS <<<"$NUM_PROMPTS"
    (( ${#COUNTS[@]} <= 1 || ${#COUNTS[@]} == ${#LEVELS[@]} )) || die "--num-prompts: one count, or one per level (${#LEVELS[@]})"
}

# bench_levels SUBCOMMAND ARGS...: one mindie-bench call for all levels, or one per level when the
# request counts differ by level; exit status: the worst.
bench_levels() {
    local sub="$1" rc=0 i; shift
    if (( ${#COUNTS[@]} <= 1 )); then
        local n=(); [[ -n "$NUM_PROMPTS" ]] && n=(--num-prompts "$NUM_PROMPTS")
        "${BENCH[@]}" "$sub" "$@" --concurrency "$CONC" "${n[@]}" "${EXTRA[@]}" "${BENCH_ARGS[@]}" || rc=$?
        return "$rc"
    fi
    for i in "${!LEVELS[@]}"; do
        "${BENCH[@]}" "$sub" "$@" --concurrency "${LEVELS[$i]}" --num-prompts "${COUNTS[$i]}" \
            "${EXTRA[@]}" "${BENCH_ARGS[@]}" || rc=$?
    done
    return "$rc"
}
