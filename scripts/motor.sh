#!/usr/bin/env bash
# A local MindIE Motor fleet: one coordinator in front of N server instances on this host, from
# MindIE Motor's user_config.json (deploy_config, mindie_ms_coordinator_config, the instances'
# server config).
#
#   scripts/motor.sh --config user_config.json [--run-dir DIR] [--ready-timeout S] [-- LAUNCH.SH OPTIONS]
#
# Derives each instance's config.json (ports, run directory) and the coordinator's
# ms_coordinator.json (its instances list) into the run directory, starts every instance with
# scripts/launch.sh, waits for them (bounded), starts the coordinator (python -m
# coordinator) and prints one "mindie-motor ready: ..." line. SIGTERM/SIGINT, or the
# coordinator's stopService, drains them all. The logic is coordinator/fleet/ (plan.py derives, run.py
# runs, cli.py is this command line: --help for everything); docs/operations.md, "Fleet".
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
# The checkout's own packages first (as launch.sh); no cd: a relative --config is the caller's.
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export MINDIE_MOTOR_PROG="${MINDIE_MOTOR_PROG:-motor.sh}"
# exec: the signals reach the fleet's supervisor directly (it drains in order, then exits).
exec "${PYTHON:-python3}" -m coordinator.fleet "$@"
