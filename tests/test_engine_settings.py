"""The engine and kernel settings are config keys (BackendConfig.cpuTuning, tpStartTimeoutS,
tpCollectiveTimeoutS, gcFreeze): each reaches the launch plan from the file or from its
environment override, every device-dependent default is settled once in the plan
(workers.prepare), and the worker's modules run with the plan's values (workers/settings.py).
The worker's Welcome tells the front end the model's vocabulary size and maximum positions."""
from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from mindie.config import ConfigError, load_config
from mindie.contract import wire as P
from mindie.contract.spec import EngineConfig, settle_engine
from mindie.topology import build_deployment

AVX512_BF16 = "flags : fpu avx2 fma avx512f avx512_bf16"
AVX2 = "flags : fpu avx2 fma"

# key under BackendConfig -> (a value other than the default, the environment override's text,
# the EngineConfig attribute path)
KEYS = {
    "tpStartTimeoutS": (12.5, "12.5", "tp_start_timeout_s"),
    "tpCollectiveTimeoutS": (3, "3", "tp_collective_timeout_s"),
    "gcFreeze": (False, "off", "gc_freeze"),
    "ScheduleConfig.batchInvariant": (True, "on", "batch_invariant"),
    "cpuTuning.kernels": (False, "0", "cpu.kernels"),
    "cpuTuning.isa": ("avx2", "AVX2", "cpu.isa"),
    "cpuTuning.kernelCache": ("/tmp/k", "/tmp/k", "cpu.kernel_cache"),
    "cpuTuning.nativeBf16": (False, "0", "cpu.native_bf16"),
    "cpuTuning.linearBuckets": (False, "no", "cpu.linear_buckets"),
    "cpuTuning.prewarmGflop": (150, "150", "cpu.prewarm_gflop"),
    "cpuTuning.fusedDecode": (False, "false", "cpu.fused_decode"),
    "cpuTuning.fusedDecodeRows": (8, "8", "cpu.fused_decode_rows"),
    "cpuTuning.fusedDecodeMb": (0.5, "0.5", "cpu.fused_decode_mb"),
    "cpuTuning.int8Rows": (7, "7", "cpu.int8_rows"),
    "cpuTuning.adaptiveThreads": (False, "off", "cpu.adaptive_threads"),
    "cpuTuning.prefillAttention": ("sdpa", "SDPA", "cpu.prefill_attention"),
    "cpuTuning.prefillLinears": ("onednn", "oneDNN", "cpu.prefill_linears"),
    "cpuTuning.ggufCompute": ("native", "Native", "cpu.gguf_compute"),
}
ENV = {"tpStartTimeoutS": "MINDIE_TP_START_TIMEOUT_S", "tpCollectiveTimeoutS": "MINDIE_TP_COLLECTIVE_TIMEOUT_S",
       "gcFreeze": "MINDIE_GC_FREEZE", "ScheduleConfig.batchInvariant": "MINDIE_BATCH_INVARIANT",
       "cpuTuning.kernels": "MINDIE_CPU_KERNELS", "cpuTuning.isa": "MINDIE_CPU_ISA",
       "cpuTuning.kernelCache": "MINDIE_KERNEL_CACHE", "cpuTuning.nativeBf16": "MINDIE_CPU_BF16",
       "cpuTuning.linearBuckets": "MINDIE_CPU_LINEAR_BUCKETS", "cpuTuning.prewarmGflop": "MINDIE_CPU_PREWARM_GFLOP",
       "cpuTuning.fusedDecode": "MINDIE_CPU_FUSED_DECODE", "cpuTuning.fusedDecodeRows": "MINDIE_CPU_FUSED_DECODE_ROWS",
       "cpuTuning.fusedDecodeMb": "MINDIE_CPU_FUSED_DECODE_MB", "cpuTuning.int8Rows": "MINDIE_CPU_INT8_ROWS",
       "cpuTuning.adaptiveThreads": "MINDIE_CPU_ADAPTIVE_THREADS",
       "cpuTuning.prefillAttention": "MINDIE_CPU_PREFILL_ATTENTION",
       "cpuTuning.prefillLinears": "MINDIE_CPU_PREFILL_LINEARS", "cpuTuning.ggufCompute": "MINDIE_CPU_GGUF_COMPUTE"}


def _engine(tmp_path: Path, backend: dict, env: dict | None = None) -> EngineConfig:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"BackendConfig": {"deviceType": "cpu", **backend}}))
    return build_deployment(load_config(str(path), env=env or {}).config).workers[0].engine


def _get(engine: EngineConfig, attr: str):
    for part in attr.split("."):
        engine = getattr(engine, part)
    return engine


def _nested(key: str, value) -> dict:
    out: dict = {}
    node = out
    *path, last = key.split(".")
    for p in path:
        node = node.setdefault(p, {})
    node[last] = value
    return out


@pytest.mark.parametrize("key", sorted(KEYS))
def test_each_key_reaches_the_plan_from_the_file_and_from_its_variable(tmp_path: Path, key: str) -> None:
    value, text, attr = KEYS[key]
    default = _get(_engine(tmp_path, {}), attr)
    assert default != value
    assert _get(_engine(tmp_path, _nested(key, value)), attr) == value
    got = _get(_engine(tmp_path, {}, {ENV[key]: text}), attr)
    assert got == value
    loaded = load_config(env={ENV[key]: text})
    assert loaded.env_overrides == {f"BackendConfig.{key}": ENV[key]}


@pytest.mark.parametrize("name,text,message", [
    ("MINDIE_CPU_FUSED_DECODE_ROWS", "abc", "BackendConfig.cpuTuning.fusedDecodeRows: must be an integer or null, "
                                            'got a string "abc"'),
    ("MINDIE_CPU_FUSED_DECODE_ROWS", "65", "BackendConfig.cpuTuning.fusedDecodeRows: must be <= 64, got 65"),
    ("MINDIE_CPU_FUSED_DECODE_MB", "nan", "BackendConfig.cpuTuning.fusedDecodeMb: must be >= 0.0, got NaN"),
    ("MINDIE_CPU_FUSED_DECODE_MB", "-1", "BackendConfig.cpuTuning.fusedDecodeMb: must be >= 0.0, got -1"),
    ("MINDIE_CPU_ISA", "sse9", 'BackendConfig.cpuTuning.isa: must be one of "native", "avx2", "avx512", got "sse9"'),
    ("MINDIE_CPU_BF16", "yes", "BackendConfig.cpuTuning.nativeBf16: must be true, false or null"),
    ("MINDIE_CPU_INT8_ROWS", "-3", "BackendConfig.cpuTuning.int8Rows: must be >= 0, got -3"),
    ("MINDIE_TP_START_TIMEOUT_S", "0", "BackendConfig.tpStartTimeoutS: must be > 0.0, got 0"),
    ("MINDIE_TP_COLLECTIVE_TIMEOUT_S", "x", "BackendConfig.tpCollectiveTimeoutS: must be a number"),
])
def test_bad_values_are_refused_naming_the_key_and_the_variable(name: str, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(env={name: text})
    assert str(e.value).startswith(message) and str(e.value).endswith(f"(from environment variable {name})"), e.value


def test_bad_file_values_are_refused_naming_the_key(tmp_path: Path) -> None:
    for backend, key in (({"cpuTuning": {"fusedDecodeRows": 65}}, "BackendConfig.cpuTuning.fusedDecodeRows"),
                         ({"cpuTuning": {"isa": "sse"}}, "BackendConfig.cpuTuning.isa"),
                         ({"gcFreeze": 0}, "BackendConfig.gcFreeze")):
        with pytest.raises(ConfigError, match=rf"^{key}: .* \(in .*config.json\)"):
            _engine(tmp_path, backend)


def test_device_dependent_defaults_are_settled_once_in_the_plan(tmp_path: Path) -> None:
    """mindie.ops.launch_plan's plan leaves them None (the device may be "auto"); workers.prepare settles
    each from the device and the host's CPU; a value the config sets is kept; nothing is None."""
    from workers.prepare import settle

    spec = build_deployment(load_config(env={}).config).workers[0]
    assert spec.engine.unsettled() == ["prefill_chunk_tokens", "decode_hold_ms", "overlap", "cpu.native_bf16",
                                       "cpu.fused_decode_rows"]
    cpu = settle(spec, "cpu", "/m", AVX512_BF16).engine
    assert (cpu.overlap, cpu.prefill_chunk_tokens, cpu.decode_hold_ms) == (False, 128, 400)
    assert (cpu.cpu.native_bf16, cpu.cpu.fused_decode_rows) == (True, 64)
    assert cpu.unsettled() == []
    avx2 = settle(spec, "cuda", "/m", AVX2).engine
    assert (avx2.overlap, avx2.prefill_chunk_tokens, avx2.decode_hold_ms) == (True, 2048, 0)
    assert (avx2.cpu.native_bf16, avx2.cpu.fused_decode_rows) == (False, 64)  # the AVX2+FMA loops
    built_avx2 = settle_engine(msgspec.structs.replace(spec.engine, cpu=msgspec.structs.replace(
        spec.engine.cpu, isa="avx2")), "cpu", AVX512_BF16)
    assert built_avx2.cpu.fused_decode_rows == 64  # -mno-avx512f: the AVX2+FMA loops
    assert settle(spec, "cpu", "/m", "flags : fpu sse2 avx").engine.cpu.fused_decode_rows == 4  # portable loops
    kept = settle(build_deployment(load_config(env={"MINDIE_CPU_BF16": "0", "MINDIE_CPU_FUSED_DECODE_ROWS": "2"})
                                   .config).workers[0], "cpu", "/m", AVX512_BF16).engine
    assert (kept.cpu.native_bf16, kept.cpu.fused_decode_rows) == (False, 2)
    assert settle(spec, "cpu", "/m", AVX2).engine == settle(settle(spec, "cpu", "/m", AVX2), "cpu", "/m").engine


def test_the_engine_and_the_worker_refuse_an_unsettled_plan() -> None:
    from workers import settings
    from workers.engine.engine import Engine
    from workers.engine.model_runner import NullRunner

    from workers.backends.cpu import native_bf16
    from workers.backends.cpu_decode import rows_limit

    unsettled = EngineConfig(block_size=16, prefill_chunk_tokens=None)
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        Engine(NullRunner(vocab_size=100), unsettled, 16)
    before = settings.engine()
    try:
        settings.apply(EngineConfig())  # a hand-written spec: the CPU's two are None
        with pytest.raises(ValueError, match="cpuTuning.nativeBf16 is not settled"):
            native_bf16()
        with pytest.raises(ValueError, match="cpuTuning.fusedDecodeRows must be an integer from 0 to 64, got None"):
            rows_limit()
    finally:
        settings.apply(before)


def test_the_worker_modules_run_with_the_plans_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """settings.apply (python -m workers.worker does it first thing) puts the spec's values where
    the kernels, linears, fused decode step, int8 kernel and TP group read them."""
    from workers import settings
    from workers.backends import cpu, cpu_decode, cpu_linear, int8
    from workers.kernels import cpu_kernels
    from workers.engine import tp_group

    before = settings.engine()
    assert before.unsettled() == []  # a process without a plan: defaults + environment, settled
    plan = settle_engine(build_deployment(load_config(env={k: v[1] for k, v in (
        (ENV[key], KEYS[key]) for key in KEYS)}).config).workers[0].engine, "cpu", AVX512_BF16)
    try:
        settings.apply(plan)
        assert cpu_kernels.isa() == "avx2" and str(cpu_kernels.cache_dir()) == "/tmp/k"
        assert cpu_linear.BUCKETS is False and cpu_linear.bucket_rows(17) == 17
        assert cpu_decode.rows_limit() == 8 and cpu_decode.budget_limit_mb() == 0.5
        assert cpu.native_bf16() is False and cpu.native_bf16(AVX512_BF16) is True
        assert int8.CpuInt8Kernel(c_kernels=False).max_rows in (7, 0)  # 0: a torch without int8pack
        assert (tp_group.START_TIMEOUT_S, tp_group.COLLECTIVE_TIMEOUT_S) == (12.5, 3.0)
    finally:
        settings.apply(before)
    assert cpu_linear.BUCKETS is before.cpu.linear_buckets and tp_group.START_TIMEOUT_S == before.tp_start_timeout_s


def test_a_process_without_a_plan_reads_the_same_table() -> None:
    """A test or benchmark process without a plan: the same overrides (mindie.runtime.env), on
    the defaults, settled for this host; a value of the wrong type is refused naming the variable."""
    from workers import settings

    e = settings.standalone({"MINDIE_CPU_FUSED_DECODE_ROWS": "3", "MINDIE_CPU_KERNELS": "0",
                             "MINDIE_TP_COLLECTIVE_TIMEOUT_S": "4", "MIES_CONFIG_JSON_PATH": "/no/such/file.json"})
    assert (e.cpu.fused_decode_rows, e.cpu.kernels, e.tp_collective_timeout_s) == (3, False, 4.0)
    assert e.unsettled() == []
    with pytest.raises(ValueError, match="MINDIE_CPU_FUSED_DECODE_ROWS='abc'"):
        settings.standalone({"MINDIE_CPU_FUSED_DECODE_ROWS": "abc"})


# -- Welcome -------------------------------------------------------------------------------------

def test_welcome_carries_the_model_and_old_peers_still_decode() -> None:
    new = P.Welcome("w0", "abc", "fe", 7, 32000, 4096)
    data = msgspec.msgpack.encode(new)

    class OldWelcome(msgspec.Struct, array_like=True, gc=False, omit_defaults=True, tag=4):
        worker_id: str
        instance: str
        frontend_id: str
        seq: int

    old = msgspec.msgpack.decode(data, type=OldWelcome)
    assert (old.worker_id, old.seq) == ("w0", 7)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(OldWelcome("w0", "abc", "fe", 7)), type=P.Welcome)
    assert (back.vocab_size, back.max_position_embeddings) == (0, 0)  # an old worker: unknown


def test_the_front_end_takes_the_model_limits_from_the_welcome() -> None:
    """Until a Welcome the limits say 0 (unknown, not checked); the first one sets them in place
    (the routes hold the same Limits object), and the health probe's token follows."""
    from mindie.server.frontend import FrontEnd
    from mindie.text.validation import Limits, check_token_ids

    fe = FrontEnd.__new__(FrontEnd)
    fe.limits = Limits.from_config(max_seq_len=64, max_input_token_len=32, max_iter_times=8, truncation=1)
    fe.vocab_size = 0
    fe.model_listeners = []
    seen = []
    fe.model_listeners.append(seen.append)
    limits = fe.limits
    assert check_token_ids([5, 999999], limits) == [5, 999999]  # unknown vocabulary: not checked
    fe.learn_model(P.Welcome("w0", "i", "fe", 0))  # an old worker says nothing
    assert (limits.vocab_size, limits.max_position_embeddings, seen) == (0, 0, [])
    fe.learn_model(P.Welcome("w0", "i", "fe", 0, 1000, 16))
    assert fe.limits is limits and (limits.vocab_size, limits.max_position_embeddings) == (1000, 16)
    assert fe.vocab_size == 1000 and seen == [1000] and limits.truncation_len == 16
    with pytest.raises(Exception):
        check_token_ids([5, 1000], limits)
    fe.learn_model(P.Welcome("w1", "j", "fe", 0, 1000, 16))
    assert seen == [1000]  # nothing new


def test_the_front_end_does_not_read_the_models_config_json() -> None:
    import ast
    import inspect

    import mindie.server.frontend

    calls = [n.func.id for n in ast.walk(ast.parse(inspect.getsource(mindie.server.frontend)))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    assert "open" not in calls
