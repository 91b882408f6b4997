"""Session fixtures and the suite's two lanes.

Lanes: a test is in the ``server`` lane when it starts processes of the project (scripts/launch.sh,
scripts/motor.sh, the coordinator, device workers, any ``python -m``/script run as a subprocess);
every other test runs in process. The marker is applied here at collection, from what the test's
code, its fixtures' code and the module helpers they call name (the launch helpers of
tests/harness.py and tests/coord_harness.py, or the ``subprocess`` module); ``@pytest.mark.server``
by hand covers anything that escapes that reading. In-process tests run first, server tests after
them, so ``pytest -m "not server"`` is the fast lane and a full run fails early on a plain bug.
A test outside the server lane that still spawns the launch script or a project module is refused
at the spawn (an audit hook), so the fast lane stays free of servers.
"""
from __future__ import annotations

import collections
import dis
import functools
import inspect
import os
import sys
import time
import types

import pytest

# Names whose use means "starts the real server or a process of the project".
LAUNCH_HELPERS = frozenset({
    "Server", "demo_server", "r1_server", "start_instances", "MotorFleet", "Coordinator", "run_tp_instance",
})
# Where they live (imported as tests.harness, or as harness with tests/ on sys.path).
HARNESS_MODULES = frozenset({"harness", "coord_harness"})
# Fixtures that hand a test a running server.
SERVER_FIXTURES = frozenset({"demo_servers"})
# Modules whose use in a test's code means it starts subprocesses.
SPAWN_MODULES = frozenset({"subprocess", "multiprocessing"})
# Files of 30 s or more on 2 cores (the per-file times of a full run, 2026-12-07), longest
# first: handed out first within their lane. With `-n 3 --dist loadfile --no-loadscope-reorder`
# (setup.cfg) files go out in collection order, and a long file handed out last would keep one
# worker busy while the others idle (longest first is the classic rule against that tail).
LONG_FILES = ("test_sampler.py", "test_many_models.py", "test_server_e2e.py", "test_cpu_isa.py", "test_refuse_start.py",
              "test_memory.py", "test_gemma.py", "test_tensor_parallel.py", "test_pd.py", "test_step_width.py",
              "test_device_workers.py", "test_stop.py", "test_moe.py", "test_gguf.py", "test_fuzz.py")


@pytest.fixture(scope="session")
def demo_model() -> str:
    from workers.models.demo import ensure_demo_model
    return str(ensure_demo_model())


@pytest.fixture(scope="session")
def demo_servers(tmp_path_factory):
    """Servers shared by the whole session, one per configuration (tests/harness.SharedServers):
    for family-contract tests that only send requests and read answers."""
    from tests.harness import SharedServers

    registry = SharedServers(tmp_path_factory.mktemp("shared"))
    try:
        yield registry
    finally:
        registry.close()


# -- lanes -----------------------------------------------------------------------------------------
def _code_names(code: types.CodeType) -> set[str]:
    """Global and attribute names a function's code (nested functions included) refers to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


# Import opcodes name their module and attribute in co_names: a code object naming none of these
# imports none of them (its nested functions are read on their own).
_IMPORT_WORDS = SPAWN_MODULES | LAUNCH_HELPERS


@functools.cache
def _imports_in_code(code: types.CodeType) -> bool:
    """Whether a function imports a launch helper or a spawning module in its body (cached per code
    object: a helper shared by many tests is read once, not once per test)."""
    if _IMPORT_WORDS.isdisjoint(code.co_names):
        return any(_imports_in_code(c) for c in code.co_consts if isinstance(c, types.CodeType))
    module = ""
    for ins in dis.get_instructions(code):
        if ins.opname == "IMPORT_NAME":
            module = ins.argval
            if module in SPAWN_MODULES:
                return True
        elif (ins.opname == "IMPORT_FROM" and ins.argval in LAUNCH_HELPERS
              and module.split(".")[-1] in HARNESS_MODULES):
            return True
    return any(_imports_in_code(c) for c in code.co_consts if isinstance(c, types.CodeType))


def _suite_module(name: str, own: str) -> bool:
    """Whether module ``name`` holds tests (this one, ``own``, or another ``test_*`` module)."""
    return name == own or name.rsplit(".", 1)[-1].startswith("test_")


def _starts_processes(fn, seen: set) -> bool:
    """Whether ``fn`` (a test, a fixture or a helper of the test module) starts processes: it names a
    launch helper or a spawning module, or calls a function of its own module that does."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None or code in seen:
        return False
    seen.add(code)
    if _imports_in_code(code):
        return True
    module_globals = getattr(fn, "__globals__", {})
    for name in _code_names(code):
        value = module_globals.get(name)
        if value is None:
            continue
        if isinstance(value, types.ModuleType) and value.__name__ in SPAWN_MODULES:
            return True
        if name in LAUNCH_HELPERS and getattr(value, "__module__", "").split(".")[-1] in HARNESS_MODULES:
            return True
        # A helper of the suite (this module's or another test module's: a function or a class's
        # methods): read it too. The harnesses' own helpers count by name (LAUNCH_HELPERS).
        if _suite_module(getattr(value, "__module__", None) or "", fn.__module__):
            if isinstance(value, type):
                if any(_starts_processes(m, seen) for m in vars(value).values() if inspect.isfunction(m)):
                    return True
            elif inspect.isfunction(value) and _starts_processes(value, seen):
                return True
    return False


def _in_server_lane(item: pytest.Item, cache: dict) -> bool:
    if item.get_closest_marker("server"):
        return True
    funcs = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    for name in item.fixturenames if info else ():
        if name in SERVER_FIXTURES:
            return True
        # The suite's own fixtures (pytest's and plugins' have no baseid).
        funcs.extend(d.func for d in info.name2fixturedefs.get(name) or () if d.baseid)
    for fn in funcs:
        if fn is None:
            continue
        key = getattr(fn, "__code__", fn)
        if key not in cache:
            cache[key] = _starts_processes(fn, set())
        if cache[key]:
            return True
    return False


def pytest_configure(config: pytest.Config) -> None:
    sys.addaudithook(_spawn_guard)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    cache: dict = {}
    for item in items:
        if _in_server_lane(item, cache) and not item.get_closest_marker("server"):
            item.add_marker(pytest.mark.server)
    # In process first, the long files first within each lane; stable, so each module's tests keep
    # their order (and module fixtures their span).
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda it: (it.get_closest_marker("server") is not None, rank.get(it.path.name, len(rank))))


# -- the guard: no project process from a test outside the server lane ---------------------------------
_current: dict = {"item": None}
# What a started process's command line holds when it is one of the project's.
_PROJECT = ("launch.sh", "motor.sh", "coordinator", "workers.", "mindie", "tests/")


def pytest_runtest_setup(item: pytest.Item) -> None:
    _current["item"] = item
    _one_torch_thread()


def _one_torch_thread() -> None:
    """One intra-op torch thread in the test process: xdist runs a test process per core, and each
    process's OpenMP pool of a thread per core oversubscribes the machine, its threads spinning
    for each other (tests/test_sampler.py alone: 49 CPU-s with two threads, 36 with one). A test
    about thread counts sets its own and puts this one back; the servers a test starts get theirs
    from the config (cpuThreadsPerWorker), not from here."""
    torch = sys.modules.get("torch")
    if torch is not None and not _current.get("one_thread"):
        torch.set_num_threads(1)
        _current["one_thread"] = True


def pytest_runtest_teardown(item: pytest.Item, nextitem) -> None:
    # Module fixtures of the next test tear down here: they are the current item's business.
    _current["item"] = item


def _spawn_guard(event: str, args: tuple) -> None:
    if event != "subprocess.Popen":
        return
    item = _current["item"]
    if item is None:
        return
    argv = args[1] if len(args) > 1 else None
    words = [os.fsdecode(a) for a in argv] if isinstance(argv, (list, tuple)) else [os.fsdecode(argv or "")]
    if item.get_closest_marker("server"):
        _count_start(item, words)
        return
    if any(p in w for w in words for p in _PROJECT):
        raise RuntimeError(f"{item.nodeid} starts {' '.join(words)[:200]} but is not in the server lane: "
                           "mark it @pytest.mark.server (tests/conftest.py reads the launch helpers and "
                           "the subprocess module from the test's code and fixtures)")


# -- where the time goes: each lane's test time and the servers each file starts ---------------------
# A server start is a launch of scripts/launch.sh or scripts/motor.sh from the test process (the
# launches a started program makes itself, mindie_bench's soak say, are not seen). Each xdist
# worker sends its counts to the controller in ``workeroutput``; the controller prints them.
_STARTS = ("launch.sh", "motor.sh")
_starts: collections.Counter = collections.Counter()
_lane_seconds: collections.Counter = collections.Counter()
_lane_tests: collections.Counter = collections.Counter()
_file_seconds: dict[str, collections.Counter] = {"in-process": collections.Counter(), "server": collections.Counter()}
_t0 = time.monotonic()


def _cpu_ticks() -> tuple[int, int] | None:
    """The machine's (busy, total) CPU ticks since boot (/proc/stat), None off Linux."""
    try:
        fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


_ticks0 = _cpu_ticks()


def _count_start(item: pytest.Item, words: list[str]) -> None:
    if any(w.endswith(_STARTS) for w in words):
        _starts[item.path.name] += 1


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = getattr(session.config, "workeroutput", None)
    if out is not None:  # an xdist worker: the controller adds the counts up
        out["server_starts"] = dict(_starts)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    _starts.update(getattr(node, "workeroutput", {}).get("server_starts", {}))


_server_phase: dict = {}  # when the first server-lane report came: time and CPU ticks


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    lane = "server" if "server" in report.keywords else "in-process"
    if lane == "server" and not _server_phase:
        _server_phase.update(t=time.monotonic(), ticks=_cpu_ticks())
    _lane_seconds[lane] += report.duration
    _file_seconds[lane][report.nodeid.split("::")[0].rsplit("/", 1)[-1]] += report.duration
    if report.when == "call":
        _lane_tests[lane] += 1


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    if not _lane_tests:
        return
    tr = terminalreporter
    tr.section("where the time goes")
    for lane in ("in-process", "server"):
        tr.write_line(f"{lane} lane: {_lane_tests[lane]} tests, {_lane_seconds[lane]:.0f} s of test time "
                      "(setup, call and teardown, summed over the workers)")
        top = ", ".join(f"{name} {s:.0f}" for name, s in _file_seconds[lane].most_common(12))
        tr.write_line(f"  its files with the most (s): {top}")
    total = sum(_starts.values())
    top = ", ".join(f"{name} {n}" for name, n in _starts.most_common(15))
    tr.write_line(f"server starts (launch.sh, motor.sh): {total} in {len(_starts)} files; most: {top}")
    ticks = _cpu_ticks()

    def busy(a, b) -> str:
        return f"{100 * (b[0] - a[0]) / max(1, b[1] - a[1]):.0f} %" if a and b else "?"
    if ticks and _ticks0:
        mid = _server_phase.get("ticks") or ticks
        t_mid = _server_phase.get("t", time.monotonic())
        tr.write_line(f"the machine's {os.cpu_count()} CPUs busy: {busy(_ticks0, mid)} until the first server-lane "
                      f"result ({t_mid - _t0:.0f} s), {busy(mid, ticks)} after it (every process on the machine)")
    tr.write_line(f"session wall time {time.monotonic() - _t0:.0f} s")
