"""Device-worker supervisor: one worker process per device entry, restarted when it dies.

Runs beside the gunicorn master (a sibling under scripts/launch.sh, never its child: the
master reaps any child with waitpid(-1) and would swallow exit statuses). It reads the launch
plan (``<runDir>/deployment.json``, mindie/contract/spec.py) and
- starts one ``workers.worker`` process per ``npuDeviceIds`` entry, with device visibility
  set in its environment and, on CPU, its share of the cores; an entry of N devices is a
  tensor-parallel instance of N processes, one per device (workers/engine/tp_group.py);
- restarts a worker that exits, with exponential backoff, logging the exit code or signal; when
  any rank of an instance exits, the other ranks are killed and the group restarts together;
- stops (exit status 2) when a worker fails to start ``START_ATTEMPTS`` times in a row: each
  worker process reports ``ready`` or the reason it cannot start on a pipe
  (mindie/runtime/start_report.py), a worker that exits before it was ready is a start failure,
  and the last one's reason is the supervisor's last log line (scripts/launch.sh then stops the
  server). A worker that was ready and then dies is restarted however often it dies;
- on SIGTERM/SIGINT stops every worker (SIGTERM, then SIGKILL after a grace period) and
  exits; a worker stopped this way removes its sockets and locks from the run directory.

Nothing is orphaned, whatever dies (docs/design.md, "Liveness"): workers get SIGKILL when the
supervisor dies, even by SIGKILL (PR_SET_PDEATHSIG, set in the child before exec, and the parent
checked again right after, so a death during the fork is not missed); the supervisor gets
SIGTERM when the launcher dies, and also stops when it sees its parent change.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import signal
import subprocess
import sys
import time
import tempfile
from dataclasses import dataclass, field

from mindie.runtime.lifecycle import die_with_parent, expected_parent
from mindie.runtime.log_setup import setup_logging
from mindie.runtime.start_report import StartWatch
from mindie.contract.spec import WorkerSpec, encode_spec, read_deployment
from workers.model_host import ModelHost

log = logging.getLogger("workers.supervisor")

BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0  # a worker up this long resets its backoff
STOP_GRACE_S = 10.0
# Starts of one worker (a whole tensor-parallel group) that end before it is ready, in a row,
# before the supervisor gives up and exits with status 2: a deterministic failure (a model the
# device refuses, a port held by another program, a device that is not there) fails every time,
# and restarting it forever would leave a server that never becomes ready and never exits. With
# the backoff the three tries span about 1.5 s plus three model loads.
START_ATTEMPTS = 3
EXIT_START_FAILED = 2


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def visibility_env(device_type: str, device_ids: list[int]) -> dict[str, str]:
    """Environment that makes ``device_ids`` the only devices a worker process sees."""
    ids = ",".join(str(i) for i in device_ids)
    if device_type == "npu":
        return {"ASCEND_RT_VISIBLE_DEVICES": ids}
    if device_type == "cuda":
        return {"CUDA_VISIBLE_DEVICES": ids}
    return {}


@dataclass
class Child:
    """One npuDeviceIds entry: one worker process, or one per device of a tensor-parallel instance."""

    spec: WorkerSpec
    procs: list[subprocess.Popen] = field(default_factory=list)  # by rank; [] while down
    started: float = 0.0
    restarts: int = 0
    backoff: float = BACKOFF_START_S
    restart_at: float = 0.0
    store: str = ""  # the rendezvous file of the group's current start
    watches: list[StartWatch] = field(default_factory=list)  # by rank: how each process's start ended
    ready: bool = False  # this start reached ready (rank 0 is ready once every rank has loaded)
    start_failures: int = 0  # starts in a row that ended before ready

    @property
    def world(self) -> int:
        return 1 if self.spec.null_model else max(1, len(self.spec.device_ids))

    def poll_reports(self) -> None:
        for w in self.watches:
            w.poll()
        if not self.ready and self.watches and self.watches[0].ready:
            self.ready = True
            self.start_failures = 0

    def close_watches(self) -> None:
        for w in self.watches:
            w.close()
        self.watches = []


class Supervisor:
    def __init__(self, specs: list[WorkerSpec], parent: int | None = None, run_dir: str = "",
                 start_attempts: int = START_ATTEMPTS):
        self.children = [Child(spec) for spec in specs]
        self.stopping = False
        self.start_attempts = start_attempts
        self.exit_status = 0  # EXIT_START_FAILED once a worker failed to start start_attempts times
        self.failure = ""  # why, then
        self.parent = parent or os.getppid()
        self.run_dir = run_dir  # where tensor-parallel rendezvous files go

    def _spawn(self, child: Child) -> None:
        world = child.world
        if world > 1:
            # A fresh rendezvous file for each start of the group: a dead start's file is not reused.
            if child.store:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(child.store)
            child.store = os.path.join(self.run_dir or tempfile.gettempdir(),
                                       f"{child.spec.worker_id}-tp{child.restarts}.store")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(child.store)
        child.procs = []
        child.close_watches()
        child.ready = False
        for rank in range(world):
            env = dict(os.environ)
            # A rank sees its own device only; a single worker sees its entry's devices.
            ids = [child.spec.device_ids[rank]] if world > 1 else child.spec.device_ids
            env.update(visibility_env(child.spec.device_type, ids))
            watch = StartWatch()
            cmd = [sys.executable, "-m", "workers.worker", "--spec", encode_spec(child.spec),
                   "--start-report-fd", str(watch.child_fd)]
            if world > 1:
                cmd += ["--rank", str(rank), "--tp-store", child.store]
            # In the child between fork and exec: SIGKILL when this (single-threaded) process dies.
            # SIGKILL rather than SIGTERM: a worker stuck in a device call must not outlive us; the
            # launcher (or the next start) removes what it leaves in the run directory.
            die = functools.partial(die_with_parent, signal.SIGKILL, os.getpid())
            try:
                child.procs.append(subprocess.Popen(cmd, env=env, close_fds=True, pass_fds=(watch.child_fd,),
                                                    preexec_fn=die))
            finally:
                watch.started()
            child.watches.append(watch)
        child.started = time.monotonic()
        pids = ", ".join(str(p.pid) for p in child.procs)
        log.info("started worker %s (pid%s %s, device %s %s%s)", child.spec.worker_id, "s" * (world > 1), pids,
                 child.spec.device_type, child.spec.device_ids, f", tensor parallel x{world}" if world > 1 else "")

    def start(self) -> None:
        for child in self.children:
            self._spawn(child)

    def poll_once(self) -> None:
        """Notice dead workers and restart them when their backoff has passed. Any rank of a
        tensor-parallel instance that dies takes the whole group down: the others are killed
        and the group restarts together. A start that ends before the worker was ready counts
        towards ``start_attempts``; the last one allowed stops the supervisor instead."""
        now = time.monotonic()
        for child in self.children:
            if child.procs:
                child.poll_reports()  # before the deaths: a report written just before dying counts
                dead = [(rank, code) for rank, p in enumerate(child.procs) if (code := p.poll()) is not None]
                if not dead:
                    if now - child.started > STABLE_AFTER_S:
                        child.backoff = BACKOFF_START_S
                    continue
                others = [p for p in child.procs if p.poll() is None]
                for p in others:
                    p.kill()  # a rank left alone waits in a collective: nothing to save there
                for p in others:
                    try:  # bounded: a rank stuck in a device call must not stop this loop
                        p.wait(5)
                    except subprocess.TimeoutExpired:
                        log.error("pid %d (worker %s) did not die within 5 s of SIGKILL (stuck in the kernel?)",
                                  p.pid, child.spec.worker_id)
                child.poll_reports()  # the dead ranks' pipes are at their end now: read it all
                reasons = [w.reason for w in child.watches]
                child.close_watches()
                child.procs = []
                # Every rank found dead, not the first: a peer's death often ends rank 0 too (its
                # collective fails) before this loop looks, and the cause must stay in the log.
                who = ", ".join(f"rank {rank} of worker {child.spec.worker_id} {describe_exit(code)}"
                                if child.world > 1 else f"worker {child.spec.worker_id} {describe_exit(code)}"
                                for rank, code in dead)
                stopped = f"stopped its {len(others)} other rank(s); " if child.world > 1 else ""
                if child.ready:
                    child.restarts += 1
                    child.restart_at = now + child.backoff
                    log.error("%s after %.1f s; %srestarting in %.1f s (restart #%d)", who, now - child.started,
                              stopped, child.backoff, child.restarts)
                    child.backoff = min(child.backoff * 2, BACKOFF_MAX_S)
                    continue
                child.start_failures += 1
                # The reasons the dead processes reported; a rank that died without one (a signal,
                # or a peer's failure after its own start went well) only when none reported any.
                told = [(rank, reasons[rank]) for rank, _ in dead if reasons[rank]] or \
                    [(rank, describe_exit(code)) for rank, code in dead]
                why = "; ".join((f"rank {rank}: " if child.world > 1 else "") + text for rank, text in told)
                if child.start_failures >= self.start_attempts:
                    log.error("%s after %.1f s, before it was ready: %s; %sno restart", who, now - child.started,
                              why, stopped)
                    self.failure = (f"worker {child.spec.worker_id} failed to start {child.start_failures} times in a "
                                    f"row, the last time: {why}")
                    self.exit_status = EXIT_START_FAILED
                    self.stopping = True
                    return
                child.restarts += 1
                child.restart_at = now + child.backoff
                log.error("%s after %.1f s, before it was ready: %s; %srestarting in %.1f s (start failure %d of "
                          "%d)", who, now - child.started, why, stopped, child.backoff, child.start_failures,
                          self.start_attempts)
                child.backoff = min(child.backoff * 2, BACKOFF_MAX_S)
            elif not self.stopping and now >= child.restart_at:
                self._spawn(child)

    def run(self) -> None:
        self.start()
        while not self.stopping:
            self.poll_once()
            if os.getppid() != self.parent:
                log.error("launcher (pid %d) is gone: stopping", self.parent)
                break
            time.sleep(0.2)
        self.stop()
        if self.failure:
            # The supervisor's last line: what launch.sh's "supervisor ... exited with status 2" stands for.
            log.error("%s: the server stops (supervisor exit status %d)", self.failure, self.exit_status)

    def stop(self) -> None:
        """SIGTERM the workers (rank 0 of each instance first: it finishes its step and tells its
        other ranks to stop), SIGKILL what is left after the grace period."""
        self.stopping = True
        deadline = time.monotonic() + STOP_GRACE_S
        first = [c.procs[0] for c in self.children if c.procs]
        rest = [p for c in self.children for p in c.procs[1:]]
        for batch in (first, rest):
            for p in batch:
                if p.poll() is None:
                    p.terminate()
            for p in batch:
                try:
                    p.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("worker pid %d did not stop in %.0f s: SIGKILL", p.pid, STOP_GRACE_S)
                    p.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(5)
        for c in self.children:
            c.close_watches()
            if c.store:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(c.store)
        log.info("all device workers stopped")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description="Start and watch one device worker per npuDeviceIds entry of the launch plan. "
                    "Normally started by scripts/launch.sh next to gunicorn.")
    ap.add_argument("--deployment", default=os.environ.get("MINDIE_DEPLOYMENT"),
                    help="the launch plan, <runDir>/deployment.json, written by python -m mindie.ops.launch_plan and "
                         "settled by python -m workers.prepare (default: $MINDIE_DEPLOYMENT)")
    args = ap.parse_args(argv)
    setup_logging(f"supervisor pid {os.getpid()}")
    if not args.deployment:
        ap.error("no launch plan: pass --deployment or set MINDIE_DEPLOYMENT")
    try:
        dep = read_deployment(args.deployment)
    except (OSError, ValueError) as e:
        log.error("cannot read the launch plan %s: %s", args.deployment, e)
        raise SystemExit(2)
    if any(s.device_type == "auto" or not s.model_path for s in dep.workers):
        log.error("%s is not settled: run python -m workers.prepare on it first", args.deployment)
        raise SystemExit(2)
    parent = expected_parent()
    die_with_parent(signal.SIGTERM, parent)  # the launcher dies: stop the workers and exit
    if dep.models_endpoint:  # several models (or sleep mode): the model host loads, evicts and unloads them
        return _host_models(dep, parent)
    local = [s for s in dep.workers if not s.remote]  # workerHosts: the others run on their own hosts
    if not local:
        log.error("%s lists no device worker for this host (BackendConfig.workerHost is not one of workerHosts)",
                  args.deployment)
        raise SystemExit(2)
    _serve(Supervisor(local, parent, dep.run_dir))


def _host_models(dep, parent: int) -> None:
    groups = [[s for s in g if not s.remote] for g in dep.groups]
    if not all(groups):
        log.error("several models with workers on other hosts (workerHosts) are not supported")
        raise SystemExit(2)
    _serve(ModelHost(groups, dep.max_loaded_models, dep.keep_alive_s, dep.models_endpoint, parent, dep.run_dir,
                     Supervisor, max_mem_gb=dep.max_loaded_mem_gb))


def _serve(runner: "Supervisor | ModelHost") -> None:
    """Run a Supervisor (one model) or a ModelHost (several) until SIGTERM/SIGINT asks it to stop;
    exit with its status."""

    def _stop(signum, _frame):
        log.info("signal %s: stopping device workers", signal.Signals(signum).name)
        runner.stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # SIGHUP reloads front ends only
    runner.run()
    if runner.exit_status:
        raise SystemExit(runner.exit_status)


if __name__ == "__main__":
    main()
