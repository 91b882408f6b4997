"""The right dtype and kernels for the CPU (issue 16, item 5): ``dtype: auto`` computes a bf16
checkpoint in fp32 on a CPU without native bf16 (one log line says so), and the C kernels build
and pass their tests with the AVX-512 path compiled out (MINDIE_CPU_ISA=avx2), as AVX2-only CPUs
run them."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workers import settings
from workers.backends.cpu import CpuBackend, native_bf16
from workers.kernels import cpu_kernels

ROOT = Path(__file__).resolve().parents[1]
AVX512_HOST = "avx512f" in Path("/proc/cpuinfo").read_text()


def test_native_bf16_detection(monkeypatch):
    assert native_bf16("flags : fpu sse avx2 avx512f avx512_bf16") is True
    assert native_bf16("flags : fpu sse avx2 amx_bf16 amx_tile") is True
    assert native_bf16("flags : fpu sse avx2 fma") is False
    assert native_bf16("flags : avx512f avx512bw") is False  # AVX-512 alone has no bf16 dot products
    # cpuTuning.nativeBf16 (MINDIE_CPU_BF16=1/0) overrides the detection when the plan is settled.
    from mindie.config import load_config
    from mindie.contract.spec import settle_engine
    from mindie.topology import engine_config
    for text, flags, want in (("1", "flags : avx2", True), ("0", "flags : avx512_bf16", False),
                              ("", "flags : avx512_bf16", True)):
        engine = settle_engine(engine_config(load_config(env={"MINDIE_CPU_BF16": text}).config), "cpu", flags)
        assert engine.cpu.native_bf16 is want
        monkeypatch.setattr(settings, "_engine", engine)
        assert native_bf16() is want


@pytest.mark.parametrize("native, tiles, name, checkpoint, want", [
    (False, False, "auto", "bfloat16", torch.float32),   # no fast bf16 product: fp32, exact for bf16 values
    (False, True, "auto", "bfloat16", torch.bfloat16),   # AVX2 with the C kernels' tiled bf16 products
    (True, False, "auto", "bfloat16", torch.bfloat16),
    (False, False, "auto", "float16", torch.float32),
    (False, True, "auto", "float16", torch.bfloat16),
    (True, False, "auto", "float16", torch.bfloat16),
    (False, True, "auto", "float32", torch.float32),
    (False, False, "bfloat16", "bfloat16", torch.bfloat16),  # asked for explicitly: kept
    (False, True, "auto", None, torch.float32),
    (False, True, "auto-int8", "bfloat16", torch.float32),  # int8 weights: their own products
    (False, True, "auto-gguf", "bfloat16", torch.float32),  # GGUF: fp32 rows over bf16 weights (AVX2 builds)
    (False, False, "auto-gguf", "bfloat16", torch.float32),
    (True, False, "auto-gguf", "bfloat16", torch.bfloat16),
])
def test_auto_dtype_follows_the_cpu(monkeypatch, caplog, native, tiles, name, checkpoint, want):
    import workers.backends.cpu as cpu_backend
    monkeypatch.setattr(settings, "_engine", settings.with_cpu(native_bf16=native))
    monkeypatch.setattr(cpu_backend, "bf16_tiles", lambda: tiles)
    backend = CpuBackend(1)
    with caplog.at_level("INFO", logger="workers.backends"):
        got = backend.resolve_dtype(name.split("-")[0], checkpoint, plain_weights=name == name.split("-")[0],
                                    gguf=name == "auto-gguf")
    assert got is want
    lib = cpu_kernels.load()
    w16a32 = name == "auto-gguf" and not native and tiles and lib is not None and lib.has_w16a32
    assert backend.bf16_weights is w16a32
    said = [r.getMessage() for r in caplog.records if "no native bf16" in r.getMessage()]
    assert len(said) == (1 if name.startswith("auto") and not native and checkpoint in ("bfloat16", "float16") else 0), said


def test_bf16_tiles_follow_the_kernels(monkeypatch):
    """bf16_tiles is true only with the kernels built for AVX2 with the tiled products, false with
    the kernels off (cpuTuning.kernels)."""
    import workers.backends.cpu as cpu_backend
    from workers.kernels import cpu_kernels

    lib = cpu_kernels.load()
    want = lib is not None and lib.has_avx2 and hasattr(lib, "kernels_tile_rows")
    assert cpu_backend.bf16_tiles() is bool(want)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    assert cpu_backend.bf16_tiles() is False


def _count(lib: Path, mnemonic: str) -> int:
    """Lines of the library's disassembly that name ``mnemonic`` (an instruction or a register)."""
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib)], capture_output=True, text=True,
                         timeout=120).stdout
    return sum(1 for line in out.splitlines() if mnemonic in line)


def _zmm_instructions(lib: Path) -> int:
    return _count(lib, "%zmm")


# The kernel tests that run the build's own code paths, and not the ones whose code is the same in
# every build (deselected by -k on a rerun; they run on the native build in the suite):
# - the SDPA route (cpuTuning.prefillAttention sdpa): its prompt chunks go through torch's SDPA, and
#   with a sliding window through the same kernel call, on the same inputs, as the kernels route;
# - head size 320: beyond the kernels, the whole attention object is torch's (decided in Python);
# - prompt chunks over fp16 caches or of head size 80: the prefill kernel never sees them (decided
#   in Python from the cache's dtype and head size); their 1-token decode entry is the decode
#   kernel's, which test_decode_matches_portable runs in every dtype and head size;
# - the every-row metadata, the route key, the shape guard: Python and torch only.
# That leaves the decode and prefill kernels (every layout they take or refuse themselves), the
# norms, rope and SwiGLU, the fused decode step, the products and batch invariance.
BUILD_INDEPENDENT = ("not sdpa and not (decode_matches_portable and 2-2-320)"
                     " and not (prefill_chunks_match_portable and (dt2 or 6-1-80))"
                     " and not every_row_metadata and not prompt_route_is_the_key and not mismatched_shapes")
# pytest in a fresh process, then the capabilities of the library that process loaded (one
# process, one torch import: not a second process to ask the same build).
RERUN = ("import sys, pytest\n"
         "rc = pytest.main(sys.argv[1:])\n"
         "from workers.kernels import cpu_kernels\n"
         "lib = cpu_kernels.load()\n"
         "print('CAPS', *(getattr(lib, k, None) for k in ('has_avx512', 'has_avx2', 'has_prefill', 'has_dpbf16',"
         " 'has_w16a32')), cpu_kernels.unavailable_reason())\n"
         "sys.exit(rc)\n")


def _rerun(env: dict, files: list[str], timeout: float, k: str | None = None) -> dict[str, str]:
    """The in-process lane of ``files`` on the build ``env`` selects: it must pass. Returns that
    build's capabilities (has_avx512, has_avx2, has_prefill, has_dpbf16, has_w16a32: "True"/"False")."""
    proc = subprocess.run([sys.executable, "-c", RERUN, "-q", "-x", "-p", "no:cacheprovider", *files,
                           "-m", "not server", *(["-k", k] if k else [])],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
    caps = next(line for line in reversed(proc.stdout.splitlines()) if line.startswith("CAPS ")).split()[1:]
    return dict(zip(("has_avx512", "has_avx2", "has_prefill", "has_dpbf16", "has_w16a32"), caps))


@pytest.mark.timeout(900)
def test_kernels_without_avx512_build_and_pass(tmp_path):
    """Build the kernels with -mno-avx512f into a fresh cache and run the kernel test files (the
    fused decode step's included: its portable products; batch invariance on its 8-lane products) against that build; the library has no
    AVX-512 (zmm) instruction while the native build on an AVX-512 host has some (so the flag
    really took the path out). The bf16 products' tests (tests/test_cpu_linear_rows.py) there
    check the tiled AVX2 path, which only such builds have. Tests whose code is the same in every
    build are left out (BUILD_INDEPENDENT)."""
    env = {**os.environ, "MINDIE_CPU_ISA": "avx2", "MINDIE_KERNEL_CACHE": str(tmp_path / "avx2")}
    # The in-process lane of those files: what runs on that build. The server lane there starts
    # fresh processes that find or build their own libraries (the build's plumbing, the same
    # whatever the flags: the fresh builds here, and tests/test_cpu_kernels.py's cache lookups) or
    # a whole server.
    caps = _rerun(env, ["tests/test_cpu_kernels.py", "tests/test_cpu_decode.py", "tests/test_cpu_linear_rows.py",
                        "tests/test_batch_invariance.py"], 800, k=BUILD_INDEPENDENT)
    built = list((tmp_path / "avx2").glob("cpu_kernels-*.so"))
    assert len(built) == 1, built
    assert _zmm_instructions(built[0]) == 0
    # the 8-lane AVX2+FMA paths are what that build runs (every AVX-512 CPU has AVX2 and FMA)
    flags = Path("/proc/cpuinfo").read_text()
    if " avx2 " in flags and " fma " in flags:
        assert [caps["has_avx512"], caps["has_avx2"], caps["has_prefill"]] == ["False", "True", "True"], caps
    if AVX512_HOST:
        # The native build: this process's own when it is one (the kernel tests built it), else a fresh one.
        lib = cpu_kernels.load()
        if lib is not None and cpu_kernels.isa() == "native":
            native_lib = Path(lib._name)
        else:
            native = {**os.environ, "MINDIE_CPU_ISA": "native", "MINDIE_KERNEL_CACHE": str(tmp_path / "native")}
            subprocess.run([sys.executable, "-c", "from workers.kernels import cpu_kernels; "
                            "assert cpu_kernels.load() is not None, cpu_kernels.unavailable_reason()"],
                           cwd=ROOT, env=native, check=True, timeout=300)
            [native_lib] = list((tmp_path / "native").glob("cpu_kernels-*.so"))
        assert _zmm_instructions(native_lib) > 0


@pytest.mark.skipif(not AVX512_HOST, reason="needs an AVX-512 host")
@pytest.mark.timeout(600)
def test_kernels_without_avx512_bf16_build_and_pass(tmp_path):
    """MINDIE_CPU_ISA=avx512 builds the kernels as an AVX-512 CPU without native bf16 (Skylake-SP
    to Ice Lake) runs them: no vdpbf16ps in the library, AVX-512 kept, and bf16 weights widened in
    registers (``has_w16a32``: fp32 rows over bf16 weights, the register tiles) where such a CPU
    would otherwise compute bf16 in the portable loops and an fp32 model over fp32 copies. The
    bf16 products' and the fused decode step's tests pass on that build, and so do the bf16 prompt
    chunks of the prefill kernel, which such a build scores in fp32 (no vdpbf16ps): the one
    attention path that differs from the native build's (decode attention, the norms and rope do
    not depend on avx512_bf16)."""
    env = {**os.environ, "MINDIE_CPU_ISA": "avx512", "MINDIE_KERNEL_CACHE": str(tmp_path / "avx512")}
    caps = _rerun(env, ["tests/test_cpu_linear_rows.py", "tests/test_cpu_decode.py", "tests/test_cpu_kernels.py"], 550,
                  k="not test_cpu_kernels.py or (prefill and not sdpa and not dt0 and not dt2)")
    [built] = list((tmp_path / "avx512").glob("cpu_kernels-*.so"))
    assert _count(built, "vdpbf16ps") == 0 and _zmm_instructions(built) > 0
    assert [caps["has_avx512"], caps["has_dpbf16"], caps["has_w16a32"]] == ["True", "False", "True"], caps


def test_bad_isa_name_falls_back_with_a_reason(tmp_path):
    """In a process without a plan a bad MINDIE_CPU_ISA leaves the kernels unavailable with the
    reason; the server's launch refuses it naming the key and the variable (the config)."""
    env = {**os.environ, "MINDIE_CPU_ISA": "sse9", "MINDIE_KERNEL_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", "from workers.kernels import cpu_kernels; "
                          "print(cpu_kernels.load(), cpu_kernels.unavailable_reason())"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("None") and "cpuTuning.isa (MINDIE_CPU_ISA) must be one of native, avx2, avx512" in out.stdout, out
    from mindie.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=r'^BackendConfig\.cpuTuning\.isa: must be one of "native", "avx2", "avx512", got "sse9" '
                                          r"\(from environment variable MINDIE_CPU_ISA\)"):
        load_config(env={"MINDIE_CPU_ISA": "sse9"})


def test_dispatch_names_follow_the_cpu_flags():
    """The dispatch line's parts (workers/backends/cpu_dispatch.py) by instruction set: AMX, then
    AVX512-BF16, then AVX2+FMA; bf16 products named by what oneDNN runs them on."""
    from workers.backends.cpu_dispatch import isa_name, products_name
    assert isa_name({"avx2", "fma", "f16c"}, None) == "avx2+fma (no avx512/amx)"
    assert isa_name({"avx2", "fma", "avx512f", "avx512_bf16"}, None) == "avx512+avx512_bf16"
    assert isa_name({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"}, None) == "avx512+avx512_bf16+amx_bf16"
    assert isa_name({"sse2"}, None) == "no avx2"
    avx2_build = type("Lib", (), {"has_avx512": False})()
    assert isa_name({"avx2", "fma", "avx512f"}, avx2_build) == "avx512, kernels built for avx2"
    assert products_name(torch.bfloat16, {"avx2", "avx512f", "amx_bf16"}) == "torch bf16 (oneDNN amx_bf16)"
    assert products_name(torch.bfloat16, {"avx2", "avx512f", "avx512_bf16"}) == "torch bf16 (oneDNN avx512_bf16)"
    assert products_name(torch.float32, {"avx2", "fma"}) == "torch fp32 (oneDNN avx2)"
    assert products_name(torch.float32, {"avx2", "avx512f"}) == "torch fp32 (oneDNN avx512)"
    assert "not prepacked" in products_name(torch.bfloat16, {"avx2"}, packed=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_logs_its_dispatch_once_and_describes_it(tmp_path, caplog, dtype):
    """prepare_model decides the kernels for the model and logs one "cpu kernels:" line; the
    device description (/v1/config's workers) carries the same line. On this host: the build's
    attention kernels (avx512 or avx2) and the fused step's row limit from the settled plan."""
    from tests.tiny_hf import save_random_model
    from workers.kernels import cpu_kernels
    from workers.models.loader import load_model
    save_random_model("LlamaConfig", dict(vocab_size=203, hidden_size=128, intermediate_size=112, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                          bos_token_id=1, eos_token_id=2), tmp_path / "m")  # head size 32
    lib = cpu_kernels.load()
    backend = CpuBackend(1)
    model, _ = load_model(tmp_path / "m", dtype)
    with caplog.at_level("INFO", logger="workers.backends"):
        backend.prepare_model(model)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cpu kernels: ")]
    assert len(lines) == 1, lines
    line = lines[0]
    assert line == "cpu kernels: " + backend.dispatch.line() and backend.dispatch.line() in backend.describe()
    flags = Path("/proc/cpuinfo").read_text()
    if lib is None:
        assert "decode attention=torch" in line
        return
    kind = "avx512" if lib.has_avx512 else "avx2" if lib.has_avx2 else "portable"
    assert f"decode attention=C {kind}," in line, line
    assert f"dtype={str(dtype).replace('torch.', '')}" in line
    assert f"fused decode step=on up to {settings.cpu().fused_decode_rows} rows" in line, line
    # AMX tiles in the fused step exactly where the build has them, the OS granted them and bf16 computes
    assert ("amx_bf16 tiles" in line) == bool(getattr(lib, "amx_rows", 0) and dtype == torch.bfloat16), line
    assert not getattr(lib, "amx_rows", 0) or "amx_bf16" in flags.split()
    # prompt chunks: the C kernel unless cpuTuning.prefillAttention asks for SDPA
    assert "prefill attention=torch SDPA per sequence" not in line and "prefill attention=C " in line, line
    # bf16 prompt chunks on AMX tiles exactly where the build has them and the OS granted them
    assert ("prefill attention=C amx_bf16 tiles," in line) == (lib.prefill_amx and dtype == torch.bfloat16), line
    assert not lib.prefill_amx or "amx_bf16" in flags.split()
    if " avx2 " in flags and " fma " in flags and not AVX512_HOST:
        assert lib.has_avx2 and lib.has_prefill and line.startswith("cpu kernels: isa=avx2+fma (no avx512/amx)")
        assert "prefill attention=C avx2 for fresh prompts up to 1024 tokens, else SDPA" in line
