"""Launcher step before anything starts: validate the config, make the run directory and
write the launch plan (``<runDir>/deployment.json``, see mindie/contract/spec.py). Prints
``NAME=value`` shell assignments for scripts/launch.sh; ``python -m workers.prepare`` then
settles the device side of the plan.

Before writing anything it claims the run directory for the launcher
(mindie/runtime/lifecycle.py): a run directory in use by a live server is refused, and what a
server that died left there (sockets, locks, state files) is removed.

Fails with exit status 2 and a message naming the config key when the config is wrong (a
configured model's tokenizer that does not load included: ``check_tokenizer``), or naming the run
directory when another server uses it.
"""
from __future__ import annotations

import glob
import logging
import os
import shlex
import sys
import time

from mindie.config import LOG_LEVELS, ConfigError, ensure_run_dir, load_config, python_log_level, setting_source
from mindie.runtime.lifecycle import RunDirBusy, claim, launcher_pid, release
from mindie.contract.spec import write_deployment
from mindie.text.detokenizer import load_tokenizer
from mindie.server.listeners import plan_listeners, write_listeners
from mindie.runtime.tls import TlsError, check_plane, permission_checks_on
from mindie.model_plan import build_many
from mindie.topology import usable_cores

log = logging.getLogger("mindie.ops.prepare")


def check_log_level_env() -> None:
    """MINDIE_LOG_LEVEL in dynamicLogLevel's words (LOG_LEVELS, any case), exported as Python's
    level name for every process; anything else refused naming the variable (exit 2)."""
    text = os.environ.get("MINDIE_LOG_LEVEL", "").strip()
    if not text:
        return
    if text.lower() not in LOG_LEVELS:
        print("config error: " + str(ConfigError(f"must be one of {', '.join(LOG_LEVELS)}, got {text!r}",
                                                 "LogConfig.dynamicLogLevel", env="MINDIE_LOG_LEVEL")), file=sys.stderr)
        print("exit 2")
        sys.exit(2)
    os.environ["MINDIE_LOG_LEVEL"] = python_log_level(text)


def main() -> None:
    check_log_level_env()
    logging.basicConfig(level=(os.environ.get("MINDIE_LOG_LEVEL") or "INFO").upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [launch] %(message)s")
    claimed = ""  # the run directory once claimed: a refusal after that leaves nothing in it
    try:
        loaded = load_config()
        config = loaded.config
        log.info("config: %s", loaded.source or "built-in defaults (no config file)")
        unknown = dict(loaded.unknown)
        for key in loaded.ignored:
            if key in unknown:
                close = unknown[key]
                log.warning("config key %s is unknown (neither this server's nor MindIE's): ignored%s", key,
                            f"; did you mean {close}?" if close else "")
            else:
                log.info("config key accepted but not used by this server (a MindIE key): %s", key)
        if unknown:
            log.warning("config: %d unknown key%s ignored (%s); ServerConfig.strictConfig: true "
                        "(launch.sh --strict-config) refuses them", len(unknown), "" if len(unknown) == 1 else "s",
                        ", ".join(unknown))
        for text in loaded.unapplied:
            log.info("config key validated but without effect in this server: %s", text)
        for note in loaded.notes:
            log.info("config adjusted as MindIE does: %s", note)
        for key, var in loaded.env_overrides.items():
            log.info("config %s set by %s", key, setting_source(var))
        ensure_run_dir(config.server.run_dir)
        try:
            stale = claim(config.server.run_dir, launcher_pid())
        except RunDirBusy as e:
            print(f"cannot start: {e}", file=sys.stderr)
            print("exit 2")
            sys.exit(2)
        claimed = config.server.run_dir
        if stale:
            log.info("removed what a server that stopped uncleanly left in %s: %s", config.server.run_dir,
                     ", ".join(stale))
        check_model_path(loaded)
        role = check_role(loaded)
        listeners = plan_listeners(config.server)
        if role != "workers":  # a workers-only host serves no HTTP: its TLS files are not needed
            check_listeners(listeners)
        b = config.backend
        if b.worker_host or b.worker_hosts:
            log.info("device-worker links: tcp on %s from port %d, %s", ", ".join(b.worker_hosts or [b.worker_host]),
                     b.worker_port,
                     f"CURVE keys in {b.worker_curve_key_dir}" if b.worker_curve_key_dir else
                     "PLAIN TCP (BackendConfig.workerInsecureTcp: true): not encrypted, not authenticated")
        level = os.environ.get("MINDIE_LOG_LEVEL") or python_log_level(config.log.dynamic_log_level
                                                                        or config.log.log_level)
        dep = build_many(config, null_model=os.environ.get("MINDIE_NULL_MODEL") == "1",
                               null_step_ms=float(os.environ.get("MINDIE_NULL_STEP_MS") or 0), log_level=level)
        check_cpu_threads(dep)
        if role != "workers":  # a workers-only host serves no HTTP: the front ends' tokenizer is not needed
            for group in dep.groups:  # every model's (several models: each ModelConfig entry)
                check_tokenizer(group[0].model_path)
        out = {
            "MINDIE_RUN_DIR": config.server.run_dir,
            "MINDIE_DEPLOYMENT": write_deployment(dep),
            "MINDIE_LISTENERS": write_listeners(listeners, config.server.run_dir),
            "MINDIE_PORT": str(config.server.port),
            # ServerConfig.drainTimeoutS, for the launcher's drain and gunicorn's stop bounds.
            "MINDIE_GRACEFUL_TIMEOUT": f"{config.server.drain_timeout_s:g}",
            # maxLinkNum is enforced per request, server-wide, by mindie/server/admission.py (a JSON 503).
            # uvicorn's limit_concurrency (per front end, connections or requests, a plain-text
            # 503) is only a memory safety net, far above the 10x overload the server must absorb.
            "MINDIE_MAX_CONNECTIONS": str(max(1024, 16 * config.server.max_link_num)),
            "MINDIE_LOG_LEVEL": level,
            **log_outputs(config.log, loaded.source),
            # frontendCount (launch.sh --frontends / MINDIE_FRONTENDS override it); 0 = one front
            # end per 4 cores, 1 to 4.
            "MINDIE_FRONTENDS": str(config.server.frontend_count or min(4, max(1, usable_cores() // 4))),
        }
    except (ConfigError, TlsError) as e:
        if claimed:
            release(claimed)
        print(f"config error: {e}", file=sys.stderr)
        print("exit 2")
        sys.exit(2)
    for k, v in out.items():
        print(f"{k}={shlex.quote(v)}")


def log_outputs(lc, source: str | None) -> dict[str, str]:
    """LogConfig as the environment every process's logging reads (mindie/runtime/log_setup.py);
    variables already set win. A relative logPath is taken from the config file's directory."""
    path = lc.log_path
    if path and not os.path.isabs(os.path.expanduser(path)):
        path = os.path.join(os.path.dirname(source) if source else os.getcwd(), path)
    values = {"MINDIE_LOG_FORMAT": lc.log_format, "MINDIE_LOG_PATH": os.path.expanduser(path) if path else "",
              "MINDIE_LOG_FILE_SIZE": str(lc.log_file_size), "MINDIE_LOG_FILE_NUM": str(lc.log_file_num)}
    out = {k: os.environ.get(k) or v for k, v in values.items()}
    if out["MINDIE_LOG_FORMAT"] not in ("text", "json"):
        raise ConfigError(f"must be text or json, got {out['MINDIE_LOG_FORMAT']!r}", "LogConfig.logFormat",
                          env="MINDIE_LOG_FORMAT")
    if out["MINDIE_LOG_PATH"]:
        log.info("logs also go to %s (one file per process, rotated at %s MB, %s kept)", out["MINDIE_LOG_PATH"],
                 out["MINDIE_LOG_FILE_SIZE"], out["MINDIE_LOG_FILE_NUM"])
    return out


ROLES = ("all", "workers", "frontends")


def check_role(loaded) -> str:
    """``MINDIE_ROLE`` (launch.sh --workers-only / --frontends-only): the two halves of a server
    on different hosts talk over tcp, so workerHost must be set."""
    role = os.environ.get("MINDIE_ROLE") or "all"
    if role not in ROLES:
        raise ConfigError(f"must be one of {', '.join(ROLES)}, got {role!r}", env="MINDIE_ROLE")
    b = loaded.config.backend
    if role == "all" and b.worker_hosts and not b.worker_host:
        raise ConfigError("workerHosts is set but this host's own workerHost is not: set workerHost to the address "
                          "this host's device workers bind (one of workerHosts), or start with --frontends-only",
                          "BackendConfig.workerHost", source=loaded.source)
    if role != "all":
        if not b.worker_host and not (role == "frontends" and b.worker_hosts):
            raise ConfigError("--workers-only and --frontends-only need the device workers on tcp: set workerHost "
                              "(the workers' host address) and workerPort, and workerCurveKeyDir (the same keys on "
                              "both hosts)", "BackendConfig.workerHost", source=loaded.source)
        hosts = ", ".join(b.worker_hosts or [b.worker_host])
        log.info("role %s: %s", role, "device workers only, for the front ends of another host" if role == "workers"
                 else f"front ends only, connected to the device workers at {hosts} from port {b.worker_port}")
    return role


MODEL_PATH_KEY = "BackendConfig.ModelDeployConfig.ModelConfig[0].modelWeightPath"


def check_model_path(loaded) -> None:
    """A configured model path that does not exist: ConfigError naming the key and where the path
    came from, before anything starts (workers.prepare checks what the path holds)."""
    for i, model in enumerate(loaded.config.backend.model_deploy.models):
        path = model.model_weight_path
        key = MODEL_PATH_KEY.replace("[0]", f"[{i}]")
        if path and not os.path.exists(path):
            raise ConfigError(f"{path} does not exist (a Hugging Face model directory or a .gguf file is expected)",
                              key, env=loaded.env_overrides.get(key), source=loaded.source)


def check_tokenizer(model_dir: str) -> None:
    """The front ends' tokenizer loads from ``model_dir`` (with their own loader,
    mindie/text/detokenizer.py), else ConfigError naming modelWeightPath: a front end that cannot load
    it never boots. "" (the demo model, made later by workers.prepare), a path that is not a
    directory (a GGUF file, or workers.prepare says what is wrong) and a folder holding a GGUF file
    (its tokenizer is converted by workers.prepare, into the model view the front ends then read)
    are left to workers.prepare, which checks the rest of the model."""
    if not model_dir or not os.path.isdir(model_dir):
        return
    if not os.path.isfile(os.path.join(model_dir, "config.json")) and any(
            name.lower().endswith(".gguf") for name in os.listdir(model_dir)):
        return
    missing = missing_parts(model_dir)
    # No config.json or no tokenizer.json: say all the folder lacks, not what the first reader of it
    # tripped on (weights alone missing: workers.prepare says so, after its own checks of config.json).
    if set(missing) & {"no config.json", "no tokenizer.json"} and not any(
            name.lower().endswith(".gguf") for name in os.listdir(model_dir)):
        empty = "the folder is empty; " if not os.listdir(model_dir) else ""
        raise ConfigError(f"{model_dir} is not a model folder: {', '.join(missing)} ({empty}a Hugging Face model "
                          "directory holds config.json, *.safetensors weights and tokenizer.json; or give a .gguf "
                          "file)",
                          MODEL_PATH_KEY) from None
    t0 = time.perf_counter()
    try:
        tok = load_tokenizer(model_dir)
    except Exception as e:  # noqa: BLE001  (tokenizers raises plain Exception for a missing or bad file)
        raise ConfigError(f"{model_dir}: the tokenizer does not load from {os.path.join(model_dir, 'tokenizer.json')}: "
                          f"{e}", "BackendConfig.ModelDeployConfig.ModelConfig[0].modelWeightPath") from None
    log.info("tokenizer check: %s loads (%d tokens); in %.2f s", os.path.join(model_dir, "tokenizer.json"),
             tok.vocab_size, time.perf_counter() - t0)


def missing_parts(model_dir: str) -> list[str]:
    """What a Hugging Face model folder lacks, as ``no config.json`` etc. ([] = all three there;
    whether they load is checked after: the tokenizer here, the weights by workers.prepare)."""
    def has(*patterns: str) -> bool:
        return any(glob.glob(os.path.join(glob.escape(model_dir), p)) for p in patterns)

    out = []
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        out.append("no config.json")
    if not has("*.safetensors", "*.safetensors.index.json"):
        out.append("no *.safetensors weights" + (" (pytorch_model*.bin only: convert it to safetensors)"
                                                 if has("pytorch_model*.bin") else ""))
    if not os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        out.append("no tokenizer.json")
    return out


def check_cpu_threads(dep) -> None:
    """Warn (stderr, like every log line here) when the CPU workers' threads exceed the usable
    cores: OpenMP pools then oversubscribe the cores and the workers slow each other down."""
    # deviceType auto is settled later (workers/prepare.py): on a host without accelerators it is cpu.
    cpu = [w for w in dep.workers if w.device_type in ("cpu", "auto") and not w.null_model and not w.remote]
    ranks = [max(1, len(w.device_ids)) for w in cpu]  # a tensor-parallel instance: one process per device
    procs = sum(ranks)
    total = sum(w.threads * n for w, n in zip(cpu, ranks))
    cores = usable_cores()
    if cpu and total > cores:
        log.warning("%d CPU worker processes x %d threads = %d threads on %d usable cores (CPU affinity, cgroup "
                    "quota): the workers will slow each other down; set BackendConfig.cpuThreadsPerWorker to %d or "
                    "less (0: the cores shared automatically) or run fewer workers", procs, cpu[0].threads, total,
                    cores, max(1, cores // procs))


def check_listeners(listeners) -> None:
    """Log what each listener serves; with TLS, load every file now (a bad one stops the start,
    naming its key) and log its warnings."""
    for li in listeners:
        planes = " + ".join(li.planes)
        if li.tls is None:
            log.info("%s plane%s on %s (plain HTTP)", planes, "s" * (len(li.planes) > 1), li.url)
            continue
        _, warnings = check_plane(li.tls)
        for w in warnings:
            log.warning("%s", w)
        if li.tls.key_password_file:
            log.info("%s: %s read as a plain-text password (MindIE's KMC-encrypted form is not supported)",
                     li.tls.password_key, li.tls.key_password_file)
        log.info("%s plane%s on %s (TLS 1.2+, %s)", planes, "s" * (len(li.planes) > 1), li.url,
                 "mutual TLS" + (", CRL checked" if li.tls.crl_files else "") if li.tls.ca_files
                 else "no client certificates")
    if any(li.tls for li in listeners) and not permission_checks_on():
        log.warning("MINDIE_TLS_CHECK_PERMISSIONS=0: the permissions of the TLS files are not checked")


if __name__ == "__main__":
    main()
