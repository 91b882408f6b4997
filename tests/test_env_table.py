"""One configuration channel: every ``MINDIE_*`` variable the code reads is in the one table of
docs/config.md ("Environment variables"), with the config key it overrides or why it has none;
the rows with a key are exactly ``mindie.config.ENV_OVERRIDES`` (plus the LogConfig ones, which
mindie/ops/launch_plan.py applies), and every key named exists."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from mindie.config import ENV_OVERRIDES, Config

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "config.md"
SCANNED = ("mindie", "workers", "scripts", "mindie_bench", "deploy")

NAME = r"(MINDIE_[A-Z0-9_]+)"
# Python: a quoted literal that is exactly a variable name is what reads it, directly
# (os.environ.get("X"), os.environ["X"], os.getenv("X"), env.get("X"), switched_off("X")) or
# through a constant (LAUNCHER_ENV = "X", a table of names); a superset of the reads.
PY_READ = re.compile(r"""["']""" + NAME + r"""["']""")
# Shell: an expansion, $X or ${X...}.
SH_READ = re.compile(r"\$\{?" + NAME)
LOG_KEYS = {"MINDIE_LOG_LEVEL": "LogConfig.dynamicLogLevel", "MINDIE_LOG_FORMAT": "LogConfig.logFormat",
            "MINDIE_LOG_PATH": "LogConfig.logPath", "MINDIE_LOG_FILE_SIZE": "LogConfig.logFileSize",
            "MINDIE_LOG_FILE_NUM": "LogConfig.logFileNum"}


def read_names(text: str, suffix: str) -> set[str]:
    """The MINDIE_* variables a .py or .sh file's text reads."""
    return set((SH_READ if suffix == ".sh" else PY_READ).findall(text))


def names_read_by_the_code() -> dict[str, list[str]]:
    """{variable: [files reading it]} over every .py and .sh file of the scanned directories."""
    out: dict[str, list[str]] = {}
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix not in (".py", ".sh") or not path.is_file():
                continue
            for name in read_names(path.read_text(errors="replace"), path.suffix):
                out.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return out


def env_table(text: str) -> dict[str, str]:
    """{variable: its "config key" cell} of the table under "## Environment variables"."""
    section = text.split("\n## Environment variables\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3 or cells[0] == "variable" or set(cells[0]) <= set("-: "):
            continue
        m = re.fullmatch(r"`([A-Z][A-Z0-9_]*)`", cells[0])
        assert m, f"a row of the environment table must name one variable: {line}"
        assert m.group(1) not in rows, f"{m.group(1)} has two rows"
        rows[m.group(1)] = cells[1]
    return rows


def table_key(cell: str) -> str | None:
    """The config key a row's second cell names, None for "no config key: <why>"."""
    if cell.startswith("no config key:"):
        assert len(cell) > len("no config key:") + 5, f"say why there is no key: {cell}"
        return None
    m = re.match(r"`([A-Za-z][A-Za-z0-9.\[\]]*)`", cell)
    assert m, f"the cell must start with the backticked key or 'no config key: <why>': {cell}"
    return m.group(1)


def undocumented(read: dict[str, list[str]], table: dict[str, str]) -> list[str]:
    return sorted(f"{name} (read in {', '.join(files)})" for name, files in read.items() if name not in table)


def test_every_variable_the_code_reads_is_in_the_table() -> None:
    read = names_read_by_the_code()
    # The scan saw the reads it must see (a broken scan must not pass as "nothing read").
    assert {"MINDIE_CPU_ISA", "MINDIE_LAUNCHER_PID", "MINDIE_LISTENERS", "MINDIE_PRESTOP_WAIT",
            "MINDIE_BENCH", "MINDIE_GC_FREEZE"} <= set(read), sorted(read)
    assert undocumented(read, env_table(DOC.read_text())) == []


def test_a_variable_missing_from_the_table_fails() -> None:
    """The check itself: a read of a name the table lacks is reported, in Python and in shell."""
    table = env_table(DOC.read_text())
    for text, suffix in (('x = os.environ.get("MINDIE_BOGUS_SETTING", "1")', ".py"),
                         ("x = os.environ['MINDIE_BOGUS_SETTING']", ".py"),
                         ('if switched_off("MINDIE_BOGUS_SETTING"):', ".py"),
                         ('echo "${MINDIE_BOGUS_SETTING:-1}"', ".sh"), ("cd $MINDIE_BOGUS_SETTING", ".sh")):
        read = {n: ["bogus" + suffix] for n in read_names(text, suffix)}
        assert undocumented(read, table) == [f"MINDIE_BOGUS_SETTING (read in bogus{suffix})"], text
    assert read_names('"MINDIE_CPU_ISA"', ".py") == {"MINDIE_CPU_ISA"}
    assert undocumented({"MINDIE_CPU_ISA": ["x.py"]}, table) == []


def test_the_table_names_the_keys_the_code_overrides() -> None:
    table = env_table(DOC.read_text())
    keys = {name: table_key(cell) for name, cell in table.items()}
    # Every override in code has its row naming the same key, and every row with a key is an
    # override in code (or a LogConfig one, applied by mindie/ops/launch_plan.py).
    assert {n: keys.get(n) for n in ENV_OVERRIDES} == ENV_OVERRIDES
    assert {n: k for n, k in keys.items() if k is not None} == {**ENV_OVERRIDES, **LOG_KEYS}
    for name, key in keys.items():
        if key is not None:
            path = re.sub(r"\[\d+\]", "[0]", key)
            assert _key_exists(path), f"{name}: no config key {key}"


def _key_exists(path: str) -> bool:
    """Whether ``path`` ('A.b[0].c') names a field of Config."""
    import typing

    import msgspec

    tp: object = Config
    for name, index in re.findall(r"\.([^.\[]+)|\[(\d+)\]", "." + path):
        while typing.get_origin(tp) is typing.Annotated:
            tp = typing.get_args(tp)[0]
        if index:
            if typing.get_origin(tp) is not list:
                return False
            tp = typing.get_args(tp)[0]
            continue
        fields = {f.encode_name: f.type for f in msgspec.structs.fields(tp)} if (
            isinstance(tp, type) and issubclass(tp, msgspec.Struct)) else {}
        if name not in fields:
            return False
        tp = fields[name]
    return True


@pytest.mark.parametrize("name", sorted(set(ENV_OVERRIDES) - {"MIES_CONTAINER_IP", "MIES_CONTAINER_MANAGEMENT_IP"}))
def test_each_override_is_read_by_the_config_only(name: str) -> None:
    """An override of a config key is read by mindie/config/env_overrides.py (the engine and kernel ones by its
    table in mindie/runtime/env.py, which the workers' plan-less processes share); outside them
    only launcher plumbing (the resolved value the launcher exports) may name it."""
    from mindie.runtime.env import ENGINE_ENV

    read = names_read_by_the_code()
    home = "mindie/runtime/env.py" if name in ENGINE_ENV else "mindie/config/env_overrides.py"
    assert home in read.get(name, []), name
    plumbing = {"MINDIE_RUN_DIR", "MINDIE_FRONTENDS", "MINDIE_PORT", "MINDIE_MODEL_PATH", "MINDIE_HOST",
                "MINDIE_MODEL_NAME", "MINDIE_DEVICE_TYPE", "MINDIE_NPU_DEVICE_IDS", "MINDIE_GRACEFUL_TIMEOUT"}
    if name not in plumbing:  # the engine and kernel settings: the workers get them from the plan
        assert [f for f in read[name] if f.startswith(("workers/", "mindie/")) and f != home] == [], read[name]
