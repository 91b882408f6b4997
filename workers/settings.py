"""This process's engine settings (``WorkerSpec.engine``), for the modules that read them where no
spec is passed: the CPU kernels, linears, fused decode step and int8 kernel (``cpu()``, the
``CpuTuning``) and the tensor-parallel group's timeouts.

``python -m workers.worker`` applies its spec's engine first thing (``apply``): the launch plan,
settled by workers.prepare, is then the only source. A process that builds models without a plan
(tests, benchmark and profiling scripts) gets, the first time a setting is read, the defaults
with the environment overrides of docs/config.md applied (the same table, read by the same
function as ``mindie.config`` uses for the plan: ``mindie.runtime.env``), settled for this
host's CPU as workers.prepare would.
"""
from __future__ import annotations

import os
import sys

import msgspec

from mindie.runtime.env import ENGINE_ENV, engine_overrides
from mindie.contract.spec import CpuTuning, EngineConfig, cpu_flags, settle_engine

_engine: EngineConfig | None = None

# Module globals that hold a setting (a hot path, or a name tests patch): {module: {name: getter}},
# set again by apply() when the module was imported before it.
_GLOBALS = {
    "workers.backends.cpu_linear": {"BUCKETS": lambda e: e.cpu.linear_buckets},
    "workers.engine.tp_group": {"START_TIMEOUT_S": lambda e: e.tp_start_timeout_s,
                                "COLLECTIVE_TIMEOUT_S": lambda e: e.tp_collective_timeout_s},
}


def apply(engine: EngineConfig) -> None:
    """Use ``engine`` (a settled plan's) from now on. What reads a setting the plan left unsettled
    (a spec written by hand: ``None``) refuses it there (the engine, ``cpu.native_bf16``, the
    fused decode step), so a worker that never reaches it (the null model) still starts."""
    global _engine
    _engine = engine
    for name, values in _GLOBALS.items():
        if (mod := sys.modules.get(name)) is not None:
            for attr, get in values.items():
                setattr(mod, attr, get(engine))


def engine() -> EngineConfig:
    global _engine
    if _engine is None:
        _engine = standalone()
    return _engine


def cpu() -> CpuTuning:
    return engine().cpu


def with_cpu(**changes) -> EngineConfig:
    """The current settings with these CpuTuning fields changed (tests: ``apply(with_cpu(...))``)."""
    e = engine()
    return msgspec.structs.replace(e, cpu=msgspec.structs.replace(e.cpu, **changes))


def standalone(env=None) -> EngineConfig:
    """The settings of a process without a launch plan: the defaults with the environment
    overrides of the engine keys applied (``mindie.runtime.env.ENGINE_ENV``, the table
    ``mindie.config`` applies to config.json; a value of the wrong type raises ValueError naming
    the variables, a value out of range is refused where it is read, as a plan never has one),
    settled for a CPU worker on this host."""
    over = engine_overrides(os.environ if env is None else env)
    top: dict = {}
    cpu: dict = {}
    for name, value in over.items():
        field = ENGINE_ENV[name][2]
        if field.startswith("cpu."):
            cpu[field[4:]] = value
        else:
            top[field] = value
    base = msgspec.to_builtins(EngineConfig())
    try:
        engine = msgspec.convert({**base, **top, "cpu": {**base["cpu"], **cpu}}, EngineConfig, strict=True)
    except msgspec.ValidationError as e:
        raise ValueError(f"{e} (environment: {', '.join(f'{n}={v!r}' for n, v in over.items())})") from None
    return settle_engine(engine, "cpu", cpu_flags())
