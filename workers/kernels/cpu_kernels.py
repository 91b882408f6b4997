"""Build and load the CPU backend's C kernels (cpu_kernels.c: paged attention, RMSNorm, rope,
int8 linear products, the fused decode step).

The source is compiled once per host with the system C compiler (``-O3 -march=native -fopenmp``)
into a cache directory keyed by the source, the compiler and the CPU's feature flags, and loaded
with ctypes (which releases the GIL while a kernel runs). The device workers of a box start
together: a file lock lets one build while the others wait, and the library is written to a
temporary file and renamed into place. Only a directory that belongs to this user and that
nobody else can write to is used.

Without a compiler, or with ``cpuTuning.kernels: false`` (``MINDIE_CPU_KERNELS=0``), ``load()`` returns None and the CPU backend
keeps the portable torch attention, norms and rope (the reason is logged once).
"""
from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from mindie.contract.spec import cpu_flags
from workers import settings

log = logging.getLogger("workers.backends")

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11",
         # Let the dot products and row updates vectorise (fp32 reassociation only).
         "-fno-math-errno", "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros"]
BUILD_TIMEOUT_S = 180
# cpuTuning.isa avx2 (MINDIE_CPU_ISA=avx2) builds without the AVX-512 and AVX-VNNI instructions -march=native would
# use (the path AVX2-only CPUs run), avx512 without AVX-512's bf16 and AMX (the path of Skylake-SP to Ice Lake Xeons); tests build
# them all on a machine that has more.
ISA_FLAGS = {"native": [], "avx2": ["-mno-avx512f", "-mno-avxvnni"],
             "avx512": ["-mno-avx512bf16", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]}


def isa() -> str:
    name = settings.cpu().isa
    if name not in ISA_FLAGS:
        raise ValueError(f"cpuTuning.isa (MINDIE_CPU_ISA) must be one of {', '.join(ISA_FLAGS)}, got {name!r}")
    return name


def build_flags() -> list[str]:
    return FLAGS + ISA_FLAGS[isa()]

_lib: ctypes.CDLL | None = None
_tried = False
_reason = ""


def cache_dir() -> Path:
    root = settings.cpu().kernel_cache or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mindie-py", "kernels")
    return Path(root)


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


def _private_dir(d: Path) -> bool:
    """Create ``d`` (mode 0700) if needed; True when it is ours and nobody else can write to it.
    A library found in a directory another user controls is never loaded."""
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = d.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022 and os.access(d, os.W_OK)


def _build(cc: str, source: Path = SOURCE, flags: list[str] | None = None) -> Path:
    """The library of ``source`` built with ``flags`` (None: this build's, ``build_flags()``)."""
    src = source.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, timeout=30).stdout
    flags = build_flags() if flags is None else flags
    key = hashlib.sha256(src + version + cpu_flags().encode() + " ".join(flags).encode()).hexdigest()[:16]
    name = f"{source.stem}-{key}.so"
    # A read-only home (containers) falls back to a private directory under the temp dir.
    dirs = (cache_dir(), Path(tempfile.gettempdir()) / f"mindie-py-kernels-{os.getuid()}")
    d = next((d for d in dirs if _private_dir(d)), None)
    if d is None:
        raise RuntimeError(f"no private writable directory for the kernels ({' nor '.join(map(str, dirs))})")
    out = d / name
    # The device workers of a box start together: one builds, the others wait for its result.
    with open(d / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists() and out.stat().st_uid == os.getuid():
            return out
        t0 = time.perf_counter()
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=d)
        os.close(fd)
        try:
            res = subprocess.run([cc, *flags, str(source), "-o", tmp, "-lm"], capture_output=True, text=True,
                                 timeout=BUILD_TIMEOUT_S)
            if res.returncode != 0:
                raise RuntimeError(f"{cc} failed: {res.stderr.strip()[-2000:]}")
            os.replace(tmp, out)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    log.info("built %s (%s) in %.1f s: %s", source.name, " ".join(flags[len(FLAGS):]) or isa(),
             time.perf_counter() - t0, out)
    return out


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set the kernels' ctypes signatures and the build's capabilities (``has_*``) on ``lib``."""
    # ... window, scale, softcap (0: none), sinks ([H] fp32 or NULL), out
    attend = [ctypes.c_float, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]
    lib.paged_decode.restype = ctypes.c_int
    lib.paged_decode.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p] \
        + [ctypes.c_int64] * 6 + attend
    lib.paged_prefill.restype = ctypes.c_int
    lib.paged_prefill.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int64] \
        + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 6 + attend
    lib.paged_write.restype = None
    lib.paged_write.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_void_p] + [ctypes.c_int64] * 5
    lib.rms_norm.restype = ctypes.c_int
    lib.rms_norm.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
    lib.rms_norm_w1.restype = ctypes.c_int
    lib.rms_norm_w1.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
    lib.rope_inplace.restype = ctypes.c_int
    lib.rope_inplace.argtypes = [ctypes.c_int, ctypes.c_void_p] + [ctypes.c_int64] * 4 \
        + [ctypes.c_void_p] * 3 + [ctypes.c_int64]
    lib.silu_mul_bf16.restype = ctypes.c_int
    lib.silu_mul_bf16.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 2
    lib.silu_mul_f32.restype = ctypes.c_int
    lib.silu_mul_f32.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
    lib.gelu_mul_f32.restype = ctypes.c_int
    lib.gelu_mul_f32.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
    lib.linear_rows.restype = ctypes.c_int
    lib.linear_rows.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.int8_unpack_t.restype = ctypes.c_int
    lib.int8_unpack_t.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.gdn_recurrent.restype = ctypes.c_int
    lib.gdn_recurrent.argtypes = [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 8
    lib.decode_layers.restype = ctypes.c_int
    lib.decode_layers.argtypes = [ctypes.c_int, ctypes.c_void_p]
    lib.kernels_have_dpbf16.restype = ctypes.c_int
    lib.has_dpbf16 = bool(lib.kernels_have_dpbf16())
    lib.kernels_have_avx512.restype = ctypes.c_int
    lib.has_avx512 = bool(lib.kernels_have_avx512())
    # the 8-lane AVX2+FMA paths (builds without AVX-512); a library built from an older source
    # (mindie-bench isa --base-kernels) lacks these two and had no AVX2 paths
    lib.has_avx2 = hasattr(lib, "kernels_have_avx2") and bool(lib.kernels_have_avx2())
    # linear_rows' dt 2 (fp32 rows over bf16 weights: cpu_linear.KernelLinear in an fp32 model)
    lib.has_w16a32 = hasattr(lib, "kernels_have_w16a32") and bool(lib.kernels_have_w16a32())
    lib.has_prefill = bool(lib.kernels_have_prefill()) if hasattr(lib, "kernels_have_prefill") else lib.has_avx512
    lib.kernels_have_f16.restype = ctypes.c_int
    lib.kernels_decode_specialised.restype = ctypes.c_int
    lib.kernels_decode_specialised.argtypes = [ctypes.c_int]
    lib.kernels_decode_specialised_for.restype = ctypes.c_int
    lib.kernels_decode_specialised_for.argtypes = [ctypes.c_int] + [ctypes.c_int64] * 3
    # the row count from which bf16 linear_rows takes its register-tiled AVX2 path (0: no such path;
    # a library from an older source lacks the function)
    if hasattr(lib, "kernels_tile_rows"):
        lib.kernels_tile_rows.restype = ctypes.c_int64
        lib.kernels_tile_rows.argtypes = [ctypes.c_int64]
    # the row count from which gemv_group's bf16 products take AMX tiles (0: no AMX in this build,
    # or the OS did not grant the tile state; a library from an older source lacks the function)
    if hasattr(lib, "kernels_amx_rows"):
        lib.kernels_amx_rows.restype = ctypes.c_int64
        lib.kernels_amx_rows.argtypes = [ctypes.c_int64]
    lib.amx_rows = int(lib.kernels_amx_rows(0)) if hasattr(lib, "kernels_amx_rows") else 0
    # whether bf16 prompt chunks take AMX tiles in paged_prefill (0: no AMX in this build or not
    # granted; a library from an older source lacks the function)
    if hasattr(lib, "kernels_prefill_amx"):
        lib.kernels_prefill_amx.restype = ctypes.c_int
        lib.kernels_prefill_amx.argtypes = [ctypes.c_int]
        lib.kernels_prefill_amx_calls.restype = ctypes.c_int64
        lib.kernels_prefill_amx_calls.argtypes = []
    lib.prefill_amx = bool(lib.kernels_prefill_amx(-1)) if hasattr(lib, "kernels_prefill_amx") else False
    lib.has_f16 = bool(lib.kernels_have_f16())  # compilers without _Float16 build fp32/bf16 only
    return lib


def load() -> ctypes.CDLL | None:
    """The kernel library, or None (see ``unavailable_reason()``)."""
    global _lib, _tried, _reason
    if _tried:
        return _lib
    _tried = True
    if not settings.cpu().kernels:
        _reason = "disabled by cpuTuning.kernels (MINDIE_CPU_KERNELS)"
    elif (cc := _compiler()) is None:
        _reason = "no C compiler (set CC)"
    else:
        try:
            import torch  # noqa: F401  (its libgomp must be loaded first so the kernels share it)
            lib = declare(ctypes.CDLL(str(_build(cc))))
            _lib = lib
        except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as e:
            _reason = f"build failed: {e}"
    if _lib is None:
        log.warning("CPU kernels unavailable (%s): using the portable torch attention, norms and rope", _reason)
    return _lib


def build_other(source: Path) -> ctypes.CDLL:
    """Another version of cpu_kernels.c built with this build's flags (benchmarks compare an older
    source in the same process: ``mindie-bench isa --base-kernels``). Raises where it cannot."""
    import torch  # noqa: F401  (its libgomp first, as load())
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC)")
    return declare(ctypes.CDLL(str(_build(cc, Path(source)))))


def unavailable_reason() -> str:
    return _reason


def dtype_code(lib: ctypes.CDLL, dtype) -> int | None:
    """The kernels' element-type code for a torch dtype (0 fp32, 1 bf16, 2 fp16), or None when
    this build does not cover it (fp16 needs a compiler with _Float16)."""
    import torch
    code = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}.get(dtype)
    return None if code == 2 and not lib.has_f16 else code
