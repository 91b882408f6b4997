#!/usr/bin/env bash
# Probe the management plane of the server (Kubernetes exec probes, Docker HEALTHCHECK).
#
#   scripts/health_check.sh [--config FILE] [--timeout S] startup|liveness|readiness|timed [N]
#   scripts/health_check.sh --coordinator [--config ms_coordinator.json] startup|liveness|readiness
#
# Reads the addresses, ports and TLS files from the server's config.json (--config, else
# $MIES_CONFIG_JSON_PATH, else the built-in defaults) with the server's own loader, so the
# environment overrides apply as for scripts/launch.sh. Exit 0 when healthy; otherwise one line
# saying why and an exit status per reason (--help lists them). Python: $PYTHON, else python3.
# --coordinator: a MindIE Motor coordinator's manage port (/v1/health, /v1/readiness), from its
# ms_coordinator.json (--config, else $MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH) read by its loader
# (coordinator/probe.py). See mindie/ops/probe.py and docs/operations.md.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
# No cd: a relative --config or $MIES_CONFIG_JSON_PATH is taken from the caller's directory, as
# scripts/launch.sh does; the repository goes on the import path (also works uninstalled).
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export MINDIE_PROBE_PROG="${MINDIE_PROBE_PROG:-health_check.sh}"
for a in "$@"; do  # a coordinator's probe reads its config with the coordinator's loader
    [ "$a" = "--coordinator" ] && exec "${PYTHON:-python3}" -m coordinator.probe "$@"
done
exec "${PYTHON:-python3}" -m mindie.ops.probe "$@"
