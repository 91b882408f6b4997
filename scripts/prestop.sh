#!/usr/bin/env bash
# Drain the server before it is stopped (Kubernetes lifecycle.preStop, MindIE's
# server_prestop.sh): GET /stopService on the management plane (it answers once the in-flight
# requests have finished, then every server process exits), then wait until the management
# port refuses connections.
#
#   scripts/prestop.sh [--config FILE] [--wait S] [--force]
#
# --wait: at most S seconds in all (default $MINDIE_PRESTOP_WAIT, else 100: keep it below the
# pod's terminationGracePeriodSeconds minus the launcher's own stop, see docs/operations.md).
# Exit 0 when drained (or when nothing was running), 4 when the server still runs after the
# wait; the other statuses as scripts/health_check.sh --help. Python: $PYTHON, else python3.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
# No cd: a relative --config or $MIES_CONFIG_JSON_PATH is taken from the caller's directory, as
# scripts/launch.sh does; the repository goes on the import path (also works uninstalled).
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
case "${1:-}" in
  -h|--help)
    sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
    exit 0 ;;
esac
export MINDIE_PROBE_PROG="${MINDIE_PROBE_PROG:-prestop.sh}"
exec "${PYTHON:-python3}" -m mindie.ops.probe stop "$@"
