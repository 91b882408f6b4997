"""Launcher step before anything starts: validate the config, resolve what "auto" means on
this host, make the run directory, make sure the model exists (generating the built-in demo
model on first use). Prints ``NAME=value`` shell assignments for scripts/launch.sh.

Fails with exit status 2 and a message naming the config key when the config is wrong.
"""
from __future__ import annotations

import logging
import os
import shlex
import sys

from mindie.config import ConfigError, ensure_run_dir, ignored_keys, load_config

log = logging.getLogger("mindie.prepare")


def main() -> None:
    logging.basicConfig(level=os.environ.get("MINDIE_LOG_LEVEL", "INFO"), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [launch] %(message)s")
    try:
        config = load_config()
        for key in ignored_keys(config):
            log.info("config key accepted but not used by this server: %s", key)
        out: dict[str, str] = {}
        if config.BackendConfig.deviceType == "auto":
            from workers.backends import detect
            out["MINDIE_DEVICE_TYPE"] = detect()
            log.info("deviceType auto -> %s", out["MINDIE_DEVICE_TYPE"])
        model = config.BackendConfig.ModelDeployConfig.ModelConfig[0]
        if model.modelWeightPath:
            if not os.path.isfile(os.path.join(model.modelWeightPath, "config.json")):
                raise ConfigError(f"{model.modelWeightPath} has no config.json (a Hugging Face model directory "
                                  "is expected)", "BackendConfig.ModelDeployConfig.ModelConfig[0].modelWeightPath")
            out["MINDIE_MODEL_DIR"] = model.modelWeightPath
        else:
            from workers.models.demo import ensure_demo_model
            out["MINDIE_MODEL_DIR"] = str(ensure_demo_model())
            log.info("no modelWeightPath configured: serving the built-in demo model at %s "
                     "(random weights, its output is gibberish)", out["MINDIE_MODEL_DIR"])
        from mindie.topology import run_dir_for
        out["MINDIE_RUN_DIR"] = ensure_run_dir(run_dir_for(config))
        out["MINDIE_HOST"] = os.environ.get("MINDIE_HOST") or config.ServerConfig.ipAddress
        out["MINDIE_PORT"] = str(config.ServerConfig.port)
        # MindIE rejects past 3*maxLinkNum connections; uvicorn's limit_concurrency does the same job.
        out["MINDIE_MAX_CONNECTIONS"] = str(3 * config.ServerConfig.maxLinkNum)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        print("exit 2")
        sys.exit(2)
    for k, v in out.items():
        print(f"{k}={shlex.quote(v)}")


if __name__ == "__main__":
    main()
