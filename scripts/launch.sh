#!/usr/bin/env bash
# Start the MindIE-compatible server: device-worker supervisor + gunicorn front ends, side by side.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: scripts/launch.sh [options]

Starts the server: one device worker per BackendConfig.npuDeviceIds entry (under a supervisor
that restarts crashed workers) and N gunicorn front ends (falcon.asgi on uvicorn) serving
POST /infer, /infer_token, GET /health, /v1/models, /metrics.

Options (each also settable by the environment variable shown):
  -c, --config FILE     MindIE-shaped config.json            [MIES_CONFIG_JSON_PATH]
                        (default: built-in defaults: demo model, CPU workers)
  -H, --host ADDR       bind address (default ServerConfig.ipAddress)   [MINDIE_HOST]
  -p, --port PORT       bind port (default ServerConfig.port = 1025)    [MINDIE_PORT]
  -w, --frontends N     number of front-end processes (default 1)       [MINDIE_FRONTENDS]
      --run-dir DIR     private directory for ipc sockets (mode 0700)   [MINDIE_RUN_DIR]
      --null-model      serve the null model (no compute; serving-stack benchmark)
                                                                        [MINDIE_NULL_MODEL=1]
      --null-step-ms MS fixed cost of one null-model step               [MINDIE_NULL_STEP_MS]
  -h, --help            show this help

Other environment: MINDIE_MODEL_PATH (ModelConfig[0].modelWeightPath), MINDIE_DEVICE_TYPE
(auto|npu|cuda|cpu), MINDIE_NPU_DEVICE_IDS ("0,1,..." = one worker per device),
MINDIE_LOG_LEVEL (INFO), MINDIE_GRACEFUL_TIMEOUT (15 s).

Signals: SIGTERM/SIGINT stop everything (front ends drain up to the graceful timeout, then
device workers stop); SIGHUP reloads the front ends without reloading the models.
USAGE
}

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
PY="${PYTHON:-python3}"

while [ $# -gt 0 ]; do
  case "$1" in
    -c|--config) export MIES_CONFIG_JSON_PATH="$2"; shift 2 ;;
    -H|--host) export MINDIE_HOST="$2"; shift 2 ;;
    -p|--port) export MINDIE_PORT="$2"; shift 2 ;;
    -w|--frontends) export MINDIE_FRONTENDS="$2"; shift 2 ;;
    --run-dir) export MINDIE_RUN_DIR="$2"; shift 2 ;;
    --null-model) export MINDIE_NULL_MODEL=1; shift ;;
    --null-step-ms) export MINDIE_NULL_STEP_MS="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "launch.sh: unknown option: $1 (see --help)" >&2; exit 2 ;;
  esac
done

# Validate the config, make the run directory and write the launch plan (front-end side,
# torch-free); then settle its device side ("auto" device, the built-in demo model, generated
# on first use). Each prints shell assignments.
eval "$("$PY" -m mindie.prepare)"
eval "$("$PY" -m workers.prepare "$MINDIE_DEPLOYMENT" || echo "exit 2")"
export MINDIE_HOST MINDIE_PORT MINDIE_RUN_DIR MINDIE_DEPLOYMENT MINDIE_MODEL_DIR MINDIE_MAX_CONNECTIONS MINDIE_LOG_LEVEL

# Prometheus multiprocess mode: a fresh directory, set before anything imports the client.
export PROMETHEUS_MULTIPROC_DIR="$MINDIE_RUN_DIR/prometheus"
rm -rf "$PROMETHEUS_MULTIPROC_DIR"; mkdir -p "$PROMETHEUS_MULTIPROC_DIR"

cd "$root"
"$PY" -m workers.supervisor --deployment "$MINDIE_DEPLOYMENT" &
sup=$!
"$PY" -m gunicorn -c "$root/deploy/gunicorn.conf.py" &
gun=$!
echo "launch.sh: supervisor pid $sup, gunicorn pid $gun, http://$MINDIE_HOST:$MINDIE_PORT" >&2

stopping=0
stop_all() {
  stopping=1
  kill -TERM "$gun" 2>/dev/null || true
  wait "$gun" 2>/dev/null || true
  kill -TERM "$sup" 2>/dev/null || true
  wait "$sup" 2>/dev/null || true
}
signalled=0
trap 'signalled=1; stop_all' TERM INT
trap 'kill -HUP "$gun" 2>/dev/null || true' HUP

status=0
while [ "$stopping" = 0 ]; do
  if wait -n "$sup" "$gun"; then status=0; else status=$?; fi
  # wait returns >128 when a trapped signal interrupted it: loop unless a child really ended.
  if [ "$stopping" = 0 ] && { ! kill -0 "$sup" 2>/dev/null || ! kill -0 "$gun" 2>/dev/null; }; then
    echo "launch.sh: a component exited (status $status); stopping the rest" >&2
    stop_all
  fi
done
rm -rf "$PROMETHEUS_MULTIPROC_DIR"
# Stopped on request: a clean exit. Otherwise a component died: report its status.
[ "$signalled" = 1 ] && status=0
exit "$status"
