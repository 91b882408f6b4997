"""Running a planned fleet (coordinator/fleet/plan.py): spawn every instance (scripts/launch.sh)
and then the coordinator, each in a session of its own; wait for them to be ready with the
probes' client; supervise (a dead or wedged coordinator is restarted, a dead instance is
restarted with backoff and the coordinator's poller admits it again); stop in order on a signal
or the coordinator's own stop: the coordinator drains first, then the instances. ``claim`` holds
the run directory's lock first, so a second motor.sh cannot touch a running fleet's files."""
from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from coordinator.fleet.plan import Plan, make_private_dirs, url
from mindie.config import ENV_OVERRIDES
# Imported here, in the parent: the preexec_fn of a child must not dlopen (libc's prctl).
from mindie.runtime.lifecycle import die_with_parent

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "scripts" / "launch.sh"

# Environment variables not passed to the instances: every override of a config key (launch.sh
# reads them over the config file, so they would move an instance off its derived config.json:
# mindie.config.ENV_OVERRIDES, added in instance_env()) and the launcher's own plumbing.
INSTANCE_ENV_DROPPED = ("MIES_CONFIG_JSON_PATH", "MINDIE_ROLE", "MINDIE_LAUNCHER_PID", "MINDIE_HUP_RESET")
COORDINATOR_ENV_DROPPED = ("MINDIE_MS_COORDINATOR_CONFIG_FILE_PATH",)

DEFAULT_READY_TIMEOUT_S = 300.0
COORDINATOR_READY_TIMEOUT_S = 60.0
COORDINATOR_STOP_S = 10.0  # beyond its drainTimeoutS: the cut and the exit
RESTARTS = 3  # coordinator deaths within RESTART_WINDOW_S before the fleet gives up
RESTART_WINDOW_S = 60.0
# A dead instance is restarted with backoff, as workers/supervisor.py restarts a worker: the wait
# doubles from INSTANCE_BACKOFF_START_S to INSTANCE_BACKOFF_MAX_S, and an instance up
# INSTANCE_STABLE_S resets it (a crash loop costs a start every 30 s, not a busy loop).
INSTANCE_BACKOFF_START_S = 0.5
INSTANCE_BACKOFF_MAX_S = 30.0
INSTANCE_STABLE_S = 60.0
# The coordinator's liveness (its manage port's /v1/health, the probe health_check.sh
# --coordinator liveness runs): one look every LIVENESS_INTERVAL_S, each bounded by
# LIVENESS_TIMEOUT_S; LIVENESS_MISSES in a row and it is killed and restarted (a stopped or wedged
# loop answers nothing). A coordinator just started gets COORDINATOR_READY_TIMEOUT_S first.
LIVENESS_INTERVAL_S = 2.0
LIVENESS_TIMEOUT_S = 2.0
LIVENESS_MISSES = 3


def say(msg: str) -> None:
    """A line of the fleet's own on stderr, "motor: <msg>"."""
    print(f"motor: {msg}", file=sys.stderr, flush=True)


def _child_env(drop) -> dict:
    return {k: v for k, v in os.environ.items() if k not in drop}


def instance_env() -> tuple[dict, list[str]]:
    """The instances' environment, and the overrides left out of it (named in a note)."""
    drop = set(INSTANCE_ENV_DROPPED) | set(ENV_OVERRIDES)
    return _child_env(drop), sorted(k for k in ENV_OVERRIDES if k in os.environ)


def _preexec() -> None:
    # A session of its own (a terminal's Ctrl-C reaches motor only, which stops the children in
    # order), and SIGTERM when motor dies, even by SIGKILL: launch.sh then drains as on a stop.
    os.setsid()
    die_with_parent(signal.SIGTERM)


def _preexec_on(cores: list[int]):
    """``_preexec`` and then the child bound to ``cores`` (its own, planned: coordinator/fleet/plan.py
    ``core_sets``): every process it starts, its device workers included, inherits the affinity."""
    if not cores:
        return _preexec

    def run() -> None:
        _preexec()
        os.sched_setaffinity(0, cores)
    return run


def _cpu_list(cores: list[int]) -> str:
    """``cores`` as /proc's Cpus_allowed_list writes them (0-3,8)."""
    runs: list[list[int]] = []
    for c in sorted(cores):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def _how(rc: int) -> str:
    """How a child ended, from its Popen returncode."""
    if rc < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-rc).name}"
        return f"was killed by signal {-rc}"
    return f"exited with status {rc}"


def _tail(path: str, n: int = 20) -> str:
    with contextlib.suppress(OSError):
        lines = Path(path).read_text(errors="replace").splitlines()[-n:]
        return "\n".join("    " + line for line in lines)
    return "    (no log)"


class Readiness:
    """One readiness check of a management plane with scripts/health_check.sh's client
    (mindie/ops/probe.py): the same TLS rules (the plane's CA, MINDIE_PROBE_CERT/KEY for mutual
    TLS), so a fleet of HTTPS instances is waited for as its probes would see it."""

    def __init__(self, config: str, coordinator: bool):
        from mindie.ops import probe
        from coordinator.probe import coordinator_target
        self.probe = probe
        self.coordinator = coordinator
        self.target = coordinator_target(config, env={}) if coordinator else probe.management_target(config, env={})
        self.ctx = None
        if self.target.tls:
            e = os.environ
            self.ctx = probe.client_context(self.target.tls, cacert=e.get("MINDIE_PROBE_CACERT", ""),
                                            cert=e.get("MINDIE_PROBE_CERT", ""), key=e.get("MINDIE_PROBE_KEY", ""),
                                            key_password_file=e.get("MINDIE_PROBE_KEY_PASSWORD_FILE", ""))
        self.last = ""

    def ready(self, timeout: float = 2.0, mode: str = "readiness") -> bool:
        """One probe (``readiness``, or ``liveness``) answered healthy within ``timeout``."""
        p = self.probe
        prober = p.Prober(self.target, time.monotonic() + timeout, self.ctx,
                          os.environ.get("MINDIE_PROBE_SERVER_NAME", ""), bool(os.environ.get("MINDIE_PROBE_CERT")))
        try:
            code, self.last = p.probe(prober, mode, 0, self.coordinator)
        except p.ProbeFailure as f:
            code, self.last = f.code, f.message
        except p._Deadline:
            code, self.last = p.TIMEOUT, f"timeout: no answer within {timeout:g} s"
        return code == p.OK


class Fleet:
    """The running fleet: N launch.sh processes and one coordinator, each in its own session."""

    def __init__(self, plan: Plan, launch_args: list[str], ready_timeout: float):
        self.plan, self.launch_args, self.ready_timeout = plan, launch_args, ready_timeout
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: list = []
        self.signals = 0
        self.coordinator_deaths: list[float] = []
        self.started: dict[str, float] = {}  # name -> when its process was (re)started
        self.backoff = {i.name: INSTANCE_BACKOFF_START_S for i in plan.instances}
        self.restart_at: dict[str, float] = {}  # a dead instance's restart time
        self.instance_env: Optional[dict] = None
        self.liveness: Optional[Readiness] = None
        self.misses = 0
        self.next_look = 0.0
        self.coordinator_seen = False  # its liveness answered since its last start

    # signals: the first drains, the second forces (launch.sh's second SIGTERM cuts the requests
    # in progress), the third kills every process group
    def on_signal(self, signum, frame) -> None:
        self.signals += 1
        if self.signals == 2:
            say(f"{signal.Signals(signum).name} again: cutting the requests in progress")
            for p in self.procs.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
        elif self.signals >= 3:
            say("asked a third time: killing every process now")
            self.kill_all()

    def kill_all(self) -> None:
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)

    def _spawn(self, name: str, argv: list[str], log: str, env: dict, cores: Optional[list[int]] = None
               ) -> subprocess.Popen:
        f = open(log, "ab")
        self.logs.append(f)
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env,
                             cwd=str(ROOT), preexec_fn=_preexec_on(cores or []))
        self.procs[name] = p
        self.started[name] = time.monotonic()
        return p

    def start_instances(self) -> None:
        env, dropped = instance_env()
        if dropped:
            say(f"note: not passed to the instances (their derived config.json is): {', '.join(dropped)}")
        env.setdefault("PYTHON", sys.executable)
        self.instance_env = env
        for inst in self.plan.instances:
            self.start_instance(inst)

    def start_instance(self, inst) -> subprocess.Popen:
        """launch.sh for one planned instance (its first start, or a restart after it died)."""
        p = self._spawn(inst.name, ["bash", str(LAUNCH), "--config", inst.config, *self.launch_args],
                        inst.log, self.instance_env or instance_env()[0], inst.cpu_cores)
        cores = f", cores {_cpu_list(inst.cpu_cores)}" if inst.cpu_cores else ""
        say(f"instance {inst.name}: launch.sh pid {p.pid}, business {url('http', inst.ip, inst.business_port)}, "
            f"management {url('http', inst.mgmt_ip, inst.mgmt_port)}{cores}, log {inst.log}")
        return p

    def start_coordinator(self) -> subprocess.Popen:
        env = _child_env(COORDINATOR_ENV_DROPPED)
        p = self._spawn("coordinator", [sys.executable, "-m", "coordinator", "--config",
                                        self.plan.coordinator_config], self.plan.coordinator_log, env)
        self.coordinator_seen = False
        say(f"coordinator: pid {p.pid}, predict {self.plan.predict_url}, manage {self.plan.manage_url}, "
            f"log {self.plan.coordinator_log}")
        return p

    def wait_instances(self) -> bool:
        deadline = time.monotonic() + self.ready_timeout
        pending = {i.name: i for i in self.plan.instances}
        checks = {i.name: Readiness(i.config, coordinator=False) for i in self.plan.instances}
        while pending:
            if self.signals:
                return False
            for name, inst in list(pending.items()):
                p = self.procs[name]
                if p.poll() is not None:
                    say(f"instance {name} failed to start: launch.sh {_how(p.returncode)}; "
                        f"its log ({inst.log}) ends:\n{_tail(inst.log)}")
                    return False
                if checks[name].ready():
                    say(f"instance {name} ready")
                    del pending[name]
            if time.monotonic() > deadline:
                for name, inst in pending.items():
                    say(f"instance {name} not ready after {self.ready_timeout:g} s (--ready-timeout; last probe: "
                        f"{checks[name].last}); its log ({inst.log}) ends:\n{_tail(inst.log)}")
                return False
            time.sleep(0.2)
        return True

    def wait_coordinator(self, p: subprocess.Popen) -> bool:
        deadline = time.monotonic() + COORDINATOR_READY_TIMEOUT_S
        check = Readiness(self.plan.coordinator_config, coordinator=True)
        while time.monotonic() < deadline and not self.signals:
            if p.poll() is not None:
                say(f"the coordinator {_how(p.returncode)} while starting; its log "
                    f"({self.plan.coordinator_log}) ends:\n{_tail(self.plan.coordinator_log)}")
                return False
            if check.ready():
                return True
            time.sleep(0.2)
        if not self.signals:
            say(f"the coordinator was not ready after {COORDINATOR_READY_TIMEOUT_S:g} s (last probe: {check.last}); its log "
                f"({self.plan.coordinator_log}) ends:\n{_tail(self.plan.coordinator_log)}")
        return False

    def ready_line(self) -> str:
        inst = ", ".join(f"{i.name}{' ' + i.role if i.role else ''} "
                         f"{url('https' if i.https else 'http', i.ip, i.business_port)}"
                         for i in self.plan.instances)
        return (f"mindie-motor ready: coordinator {self.plan.predict_url} (manage {self.plan.manage_url}) | "
                f"{len(self.plan.instances)} instance(s): {inst} | run dir {self.plan.run_dir}")

    def supervise(self) -> int:
        """Until a stop signal or the coordinator's own stop (/stopService): exit status."""
        while not self.signals:
            coord = self.procs["coordinator"]
            if coord.poll() is None:
                self.check_liveness(coord)
            if coord.poll() is not None:
                rc = coord.returncode
                if rc == 0:
                    say("the coordinator stopped by itself (exit 0, a stop it was asked for): stopping the instances")
                    return 0
                now = time.monotonic()
                self.coordinator_deaths = [t for t in self.coordinator_deaths if now - t < RESTART_WINDOW_S] + [now]
                how = _how(rc)
                if len(self.coordinator_deaths) > RESTARTS:
                    say(f"the coordinator {how}, {len(self.coordinator_deaths)} times in "
                        f"{RESTART_WINDOW_S:g} s: giving up; its log ends:\n{_tail(self.plan.coordinator_log)}")
                    return 1
                say(f"the coordinator {how}: restarting it (the instances kept serving)")
                self.start_coordinator()
                self.misses, self.next_look = 0, 0.0
            for inst in self.plan.instances:
                self.heal_instance(inst)
            time.sleep(0.2)
        return 0

    def heal_instance(self, inst) -> None:
        """A dead instance: its process group cleared, and launch.sh started again once its
        backoff has passed; the coordinator's poller sees it answer and routes to it again."""
        p, now = self.procs[inst.name], time.monotonic()
        if p.poll() is None:
            if now - self.started[inst.name] >= INSTANCE_STABLE_S:
                self.backoff[inst.name] = INSTANCE_BACKOFF_START_S
            return
        at = self.restart_at.get(inst.name)
        if at is None:
            wait = self.backoff[inst.name]
            self.restart_at[inst.name] = now + wait
            self.backoff[inst.name] = min(wait * 2, INSTANCE_BACKOFF_MAX_S)
            # what launch.sh left (a worker, a front end holding the port) goes with it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            say(f"instance {inst.name} stopped (launch.sh {_how(p.returncode)} after "
                f"{now - self.started[inst.name]:.1f} s): restarting it in {wait:g} s; the coordinator routes "
                f"around it meanwhile; its log ({inst.log}) ends:\n{_tail(inst.log, 5)}")
        elif now >= at:
            del self.restart_at[inst.name]
            say(f"instance {inst.name}: restarting (the coordinator admits it again once it is ready)")
            self.start_instance(inst)

    def check_liveness(self, coord: subprocess.Popen) -> None:
        """One bounded liveness look at the coordinator now and then; LIVENESS_MISSES in a row
        (a stopped process, a wedged loop) and it is killed, for supervise() to restart."""
        now = time.monotonic()
        if now < self.next_look or now - self.started["coordinator"] < LIVENESS_INTERVAL_S:
            return
        self.next_look = now + LIVENESS_INTERVAL_S
        if self.liveness is None:
            self.liveness = Readiness(self.plan.coordinator_config, coordinator=True)
        if self.liveness.ready(LIVENESS_TIMEOUT_S, mode="liveness"):
            self.misses, self.coordinator_seen = 0, True
            return
        if not self.coordinator_seen and now - self.started["coordinator"] < COORDINATOR_READY_TIMEOUT_S:
            return  # still starting (its first poll runs before it listens): not a miss yet
        self.misses += 1
        if self.misses < LIVENESS_MISSES:
            return
        say(f"the coordinator (pid {coord.pid}) failed its liveness probe {self.misses} times in a row "
            f"(last: {self.liveness.last}): killing it (SIGKILL) to restart it")
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(coord.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            coord.wait(10)  # a SIGKILL ends even a stopped process; its ports are free after it
        self.misses = 0

    def stop(self) -> None:
        """Coordinator first (its requests in flight finish on the instances), then every instance
        at once (launch.sh drains on SIGTERM); each wait bounded, SIGKILL to what is left."""
        coord = self.procs.get("coordinator")
        drain = max((i.drain_timeout_s for i in self.plan.instances), default=20.0)
        if coord is not None and coord.poll() is None:
            say(f"stopping the coordinator (its requests in flight get up to {self.plan.coordinator_drain_s:g} s)")
            with contextlib.suppress(ProcessLookupError):
                os.kill(coord.pid, signal.SIGTERM)
            self._wait([coord], self.plan.coordinator_drain_s + COORDINATOR_STOP_S, "the coordinator")
        live = [self.procs[i.name] for i in self.plan.instances if i.name in self.procs]
        if any(p.poll() is None for p in live):
            say(f"draining {sum(p.poll() is None for p in live)} instance(s) (up to {drain:g} s each, in parallel)")
            for p in live:
                if p.poll() is None and self.signals < 2:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGTERM)
            # launch.sh's own stop: drain + cut + front ends (+10 s) + workers (15 s)
            self._wait(live, drain + 35.0, "instances")
        # What any child left in its process group (it should be nothing).
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        for f in self.logs:
            f.close()

    def _wait(self, procs: list, bound: float, what: str) -> None:
        deadline = time.monotonic() + bound
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline and self.signals < 3:
            time.sleep(0.1)
        left = [p for p in procs if p.poll() is None]
        if left:
            say(f"{what} still running after {bound:g} s: SIGKILL to pid {' '.join(str(p.pid) for p in left)}")
            for p in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
            for p in left:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(5)


def claim(run_dir: str) -> Optional[int]:
    """An open descriptor holding the run directory's lock (``motor.lock``), or None (with a
    message) when another motor.sh holds it: its files are not touched."""
    make_private_dirs(run_dir)
    lock_path = os.path.join(run_dir, "motor.lock")
    lock = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        say(f"the run directory {run_dir} is in use by another motor.sh (its lock {lock_path} is held): "
            "stop that one first or pass --run-dir")
        return None
    return lock


def run(plan: Plan, lock: int, launch_args: list[str], ready_timeout: float) -> int:
    fleet = Fleet(plan, launch_args, ready_timeout)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, fleet.on_signal)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the terminal going away does not stop a fleet
    status = 1
    try:
        fleet.start_instances()
        if not fleet.wait_instances():
            status = 0 if fleet.signals else 1
            return status
        coord = fleet.start_coordinator()
        if not fleet.wait_coordinator(coord):
            status = 0 if fleet.signals else 1
            return status
        print(fleet.ready_line(), file=sys.stderr, flush=True)
        status = fleet.supervise()
        if fleet.signals:
            say("stop requested: draining the fleet")
        return status
    finally:
        fleet.stop()
        say("stopped" + ("" if status == 0 else f" (exit status {status})"))
        os.close(lock)
