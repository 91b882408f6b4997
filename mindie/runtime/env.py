"""The environment overrides of the engine and kernel settings: one table, read in one place.

Every ``MINDIE_*`` variable a process reads is listed in the one table of docs/config.md
("Environment variables"), with the config key it overrides (tests/test_env_table.py fails on a
variable the table lacks). The engine and kernel settings' variables are only overrides of their
config keys: ``ENGINE_ENV`` here names the key and how the text becomes its value, and
``engine_overrides`` reads them. ``mindie.config`` applies them to config.json's values before
validation (so the launch plan, which the workers apply, carries them); a process without a plan
(tests, benchmark scripts: ``workers/settings.py``) applies the same table to the defaults.
"""
from __future__ import annotations

import os
import re
from typing import Any, Callable, Mapping

OFF = ("0", "false", "no", "off")  # a switch variable's off values (any case); anything else is on


def switched_off(name: str) -> bool:
    """Whether environment variable ``name`` turns its feature off (``0``, ``false``, ``no`` or
    ``off``, any case); unset or anything else leaves it on. (The project's own switches are
    config keys now, read through ``ENGINE_ENV``.)"""
    return os.environ.get(name, "").strip().lower() in OFF


def _switch(v: str) -> bool:
    return v.lower() not in OFF


def parse_number(v: str) -> Any:
    """An int or float; anything else stays a string, reported by validation naming the variable."""
    if re.fullmatch(r"[+-]?\d+", v):
        return int(v)
    try:
        return float(v)
    except ValueError:
        return v


def _bf16(v: str) -> Any:
    return {"1": True, "0": False}.get(v, v)


def _path(v: str) -> str:
    return os.path.abspath(os.path.expanduser(v))  # relative: from the current directory


# variable -> (the config key it overrides, how its text becomes the key's JSON value, the
# EngineConfig field the key becomes: mindie.topology.engine_config)
ENGINE_ENV: dict[str, tuple[str, Callable[[str], Any], str]] = {
    "MINDIE_TP_START_TIMEOUT_S": ("BackendConfig.tpStartTimeoutS", parse_number, "tp_start_timeout_s"),
    "MINDIE_TP_COLLECTIVE_TIMEOUT_S": ("BackendConfig.tpCollectiveTimeoutS", parse_number, "tp_collective_timeout_s"),
    "MINDIE_GC_FREEZE": ("BackendConfig.gcFreeze", _switch, "gc_freeze"),
    "MINDIE_BATCH_INVARIANT": ("BackendConfig.ScheduleConfig.batchInvariant", _switch, "batch_invariant"),
    "MINDIE_CPU_KERNELS": ("BackendConfig.cpuTuning.kernels", _switch, "cpu.kernels"),
    "MINDIE_CPU_ISA": ("BackendConfig.cpuTuning.isa", str.lower, "cpu.isa"),
    "MINDIE_KERNEL_CACHE": ("BackendConfig.cpuTuning.kernelCache", _path, "cpu.kernel_cache"),
    "MINDIE_CPU_BF16": ("BackendConfig.cpuTuning.nativeBf16", _bf16, "cpu.native_bf16"),
    "MINDIE_CPU_LINEAR_BUCKETS": ("BackendConfig.cpuTuning.linearBuckets", _switch, "cpu.linear_buckets"),
    "MINDIE_CPU_PREWARM_GFLOP": ("BackendConfig.cpuTuning.prewarmGflop", parse_number, "cpu.prewarm_gflop"),
    "MINDIE_CPU_FUSED_DECODE": ("BackendConfig.cpuTuning.fusedDecode", _switch, "cpu.fused_decode"),
    "MINDIE_CPU_FUSED_DECODE_ROWS": ("BackendConfig.cpuTuning.fusedDecodeRows", parse_number, "cpu.fused_decode_rows"),
    "MINDIE_CPU_FUSED_DECODE_MB": ("BackendConfig.cpuTuning.fusedDecodeMb", parse_number, "cpu.fused_decode_mb"),
    "MINDIE_CPU_INT8_ROWS": ("BackendConfig.cpuTuning.int8Rows", parse_number, "cpu.int8_rows"),
    "MINDIE_CPU_ADAPTIVE_THREADS": ("BackendConfig.cpuTuning.adaptiveThreads", _switch, "cpu.adaptive_threads"),
    "MINDIE_CPU_PREFILL_ATTENTION": ("BackendConfig.cpuTuning.prefillAttention", str.lower, "cpu.prefill_attention"),
    "MINDIE_CPU_PREFILL_LINEARS": ("BackendConfig.cpuTuning.prefillLinears", str.lower, "cpu.prefill_linears"),
    "MINDIE_CPU_GGUF_COMPUTE": ("BackendConfig.cpuTuning.ggufCompute", str.lower, "cpu.gguf_compute"),
}


def engine_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """{variable: the key's value} of the engine overrides ``env`` sets (empty = unset)."""
    return {name: parse(v) for name, (_, parse, _) in ENGINE_ENV.items() if (v := env.get(name, "").strip())}
