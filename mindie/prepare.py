"""Launcher step before anything starts: validate the config, make the run directory and
write the launch plan (``<runDir>/deployment.json``, see mindie/contract/spec.py). Prints
``NAME=value`` shell assignments for scripts/launch.sh; ``python -m workers.prepare`` then
settles the device side of the plan.

Fails with exit status 2 and a message naming the config key when the config is wrong.
"""
from __future__ import annotations

import logging
import os
import shlex
import sys

from mindie.config import ConfigError, ensure_run_dir, load_config, python_log_level
from mindie.contract.spec import write_deployment
from mindie.topology import build_deployment

log = logging.getLogger("mindie.prepare")


def main() -> None:
    logging.basicConfig(level=os.environ.get("MINDIE_LOG_LEVEL", "INFO").upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [launch] %(message)s")
    try:
        loaded = load_config()
        config = loaded.config
        log.info("config: %s", loaded.source or "built-in defaults (no config file)")
        for key in loaded.ignored:
            log.info("config key accepted but not used by this server: %s", key)
        for note in loaded.notes:
            log.info("config adjusted as MindIE does: %s", note)
        for key, var in loaded.env_overrides.items():
            log.info("config %s set by environment variable %s", key, var)
        ensure_run_dir(config.server.run_dir)
        level = os.environ.get("MINDIE_LOG_LEVEL") or python_log_level(config.log.dynamic_log_level)
        dep = build_deployment(config, null_model=os.environ.get("MINDIE_NULL_MODEL") == "1",
                               null_step_ms=float(os.environ.get("MINDIE_NULL_STEP_MS") or 0), log_level=level)
        out = {
            "MINDIE_RUN_DIR": config.server.run_dir,
            "MINDIE_DEPLOYMENT": write_deployment(dep),
            "MINDIE_HOST": os.environ.get("MINDIE_HOST") or config.server.ip_address,
            "MINDIE_PORT": str(config.server.port),
            # MindIE rejects past 3*maxLinkNum connections; uvicorn's limit_concurrency does the same job.
            "MINDIE_MAX_CONNECTIONS": str(3 * config.server.max_link_num),
            "MINDIE_LOG_LEVEL": level,
        }
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        print("exit 2")
        sys.exit(2)
    for k, v in out.items():
        print(f"{k}={shlex.quote(v)}")


if __name__ == "__main__":
    main()
