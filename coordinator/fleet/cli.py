"""The fleet's command line (``python -m coordinator.fleet``, what scripts/motor.sh runs): ``plan``
derives, writes and prints the files (coordinator/fleet/plan.py), ``run`` (the default) also starts
and supervises the fleet until it is stopped (coordinator/fleet/run.py)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from typing import Optional

from coordinator.fleet.plan import LAUNCH_OPTIONS_DERIVED, FleetError, derive
from coordinator.fleet.run import DEFAULT_READY_TIMEOUT_S, claim, run, say

EPILOG = """\
examples:
  scripts/motor.sh --config user_config.json                 # the fleet, until SIGTERM/SIGINT
  scripts/motor.sh --config user_config.json -- --null-model --null-step-ms 20 -w 1
  python -m coordinator.fleet plan --config user_config.json   # derive and print, start nothing

A minimal user_config.json (two instances of the demo model behind a cache-affine coordinator):

  {"deploy_config": {"replicas": 2},
   "mindie_ms_controller_config": {"deploy_mode": "single_node"},
   "mindie_ms_coordinator_config": {
       "http_config": {"predict_port": "1025", "manage_port": "1026"},
       "digs_scheduler_config": {"deploy_mode": "single_node", "algorithm_type": "cache_affinity"}},
   "mindie_server_config": {"ServerConfig": {"port": 1030},
                            "BackendConfig": {"npuDeviceIds": [[0]], "deviceType": "cpu"}}}

Stop: SIGTERM or SIGINT (Ctrl-C) drains the coordinator first (new requests 503, requests in
flight run until its http_config.drainTimeoutS, then a stream still running ends with an error
frame), then drains every instance (launch.sh's drain: ServerConfig.drainTimeoutS); a second
signal cuts the requests in progress, a third kills. The coordinator's own stop (stopService)
stops the instances the same way. A coordinator that dies, or fails its liveness probe 3 times
in a row (wedged), is restarted (at most 3 times a minute); an instance that dies is restarted
with backoff (0.5 s doubling to 30 s) and the coordinator routes to it again. Every wait is
bounded. Exit status: 0 stopped on request, 1 a start failed, 2 user_config.json refused (one
line naming the key) or the run directory in use. docs/operations.md, "Fleet".
"""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    launch_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, launch_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog=os.environ.get("MINDIE_MOTOR_PROG") or "python -m coordinator.fleet",
                                description="A local MindIE Motor fleet from user_config.json: a coordinator "
                                            "in front of N server instances on this host.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", choices=("run", "plan"), default="run",
                   help="run (default): start the fleet and supervise it; plan: derive, write and print the "
                        "files, start nothing")
    p.add_argument("-c", "--config", required=True, metavar="user_config.json", help="MindIE Motor's deploy file")
    p.add_argument("--run-dir", metavar="DIR", default=None,
                   help="where the derived files, logs and the instances' run directories go (default: "
                        "$XDG_RUNTIME_DIR/mindie-motor/<predict_port>, else /tmp/mindie-py-<uid>/motor-<predict_port>)")
    p.add_argument("--ready-timeout", type=float, default=DEFAULT_READY_TIMEOUT_S, metavar="S",
                   help=f"seconds the instances get to load their models (default {DEFAULT_READY_TIMEOUT_S:g})")
    args = p.parse_args(argv)
    for a in launch_args:
        if a.split("=", 1)[0] in LAUNCH_OPTIONS_DERIVED:
            p.error(f"launch.sh option {a} after -- is derived from user_config.json per instance")
    if not args.ready_timeout > 0:
        p.error(f"--ready-timeout must be > 0, got {args.ready_timeout}")
    return args, launch_args


def main(argv: Optional[list[str]] = None) -> int:
    args, launch_args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        # First without writing: the run directory (from the ports) is claimed before its files
        # are written, so a fleet running there keeps its own.
        plan = derive(args.config, args.run_dir, write=False)
        lock = claim(plan.run_dir)
        if lock is None:
            return 2
        plan = derive(args.config, args.run_dir, write=True)
    except FleetError as e:
        print(f"motor: user_config.json refused: {e}", file=sys.stderr, flush=True)
        return 2
    for note in plan.notes:
        say(f"note: {note}")
    if args.command == "plan":
        print(json.dumps(asdict(plan), indent=2))
        os.close(lock)
        return 0
    return run(plan, lock, launch_args, args.ready_timeout)
