"""The GGUF block kernels (workers/kernels/gguf_kernels.c, issue 55 item 1): every quantised type
against gguf's own dequantiser (``gguf.quants.dequantize``, llama.cpp's Python decoders) on random
blocks, on every instruction set this host runs (the native build, the AVX2 build, the scalar
fallback), at shapes whose rows are not a multiple of the kernel's tile; and a tiny GGUF model
computed from its blocks against the same file dequantised at load."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from tests.tiny_gguf import K_QUANTS, _random_k_blocks
from workers.kernels import gguf_kernels as gk

FLAGS = Path("/proc/cpuinfo").read_text()
# each variant and the gguf_isa() it must report on this host (None: this host cannot run it)
VARIANTS = {"native": 2 if " avx512_vnni" in FLAGS and " avx512bw" in FLAGS else 1 if " avx2" in FLAGS else 0,
            "avx2": 1 if " avx2" in FLAGS else None, "scalar": 0}
TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Built at collection, as the other kernel tests load theirs (a compiler is not a process the
# in-process lane may start from a test); cached, about a second each the first time.
LIBS = {v: gk.build(v) for v, isa in VARIANTS.items() if isa is not None}


@pytest.fixture(scope="module", params=list(LIBS))
def lib(request):
    lib = LIBS[request.param]
    assert lib.isa == VARIANTS[request.param], f"{request.param} build reports {gk.ISA_NAMES[lib.isa]}"
    return lib


def random_weight(qtype: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, row bytes]: random blocks of ``qtype`` (K-quants: random bytes, small scales)."""
    rng = np.random.default_rng(seed)
    if qtype in K_QUANTS:
        return _random_k_blocks(qtype, (n, k), rng)
    return quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qtype)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m, n, k", [(1, 13, 256), (5, 37, 768), (70, 9, 512)])
def test_kernel_matches_dequantised_reference(lib, qtype, m, n, k):
    """Integer mode: exact integer dot products of the int8 activations (the kernel's own
    quantisation, itself checked against numpy) with the blocks, so the result equals those
    activations times gguf's dequantised weights to fp32 rounding; float mode: fp32 activations
    times the dequantised weights. Bias added, a column slice of a wider output written. The
    32-value types get 32 more inputs: a tail past the AVX-512 loop's 64-value steps."""
    k += 32 if GGML_QUANT_SIZES[qtype][0] == 32 else 0
    w = random_weight(qtype, n, k)
    ref_w = torch.from_numpy(dequantize(w, qtype).astype(np.float32))
    assert ref_w.shape == (n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(n)
    acts = gk.Activations(lib, x)
    # the activations: per 32 values one scale max|x| / 127, q = round(x / scale)
    blocks = x.view(m, k // 32, 32)
    scale = blocks.abs().amax(-1) / 127
    assert torch.allclose(acts.d.view(m, -1, 2)[..., 0], scale)
    assert (acts.q.view(m, -1, 32).float() - blocks / scale[..., None]).abs().max() <= 0.5 + 1e-3
    xq = acts.q.float().view(m, -1, 32) * acts.d.view(m, -1, 2)[..., :1]
    tol = 2e-5 * (xq.view(m, k).abs() @ ref_w.abs().T) + 1e-6
    out = torch.full((m, n + 3), 7.0)
    gk.matmul(lib, gk.TYPES[qtype.name], x, torch.from_numpy(w), out[:, 1:n + 1], acts=acts, bias=bias)
    want = xq.view(m, k) @ ref_w.T + bias
    assert ((out[:, 1:n + 1] - want).abs() <= tol).all(), (out[:, 1:n + 1] - want).abs().max()
    assert (out[:, 0] == 7).all() and (out[:, n + 1:] == 7).all()
    # the activation quantisation's own error is small next to the product
    exact = x @ ref_w.T + bias
    assert (out[:, 1:n + 1] - exact).abs().max() <= 0.02 * exact.abs().max()
    flt = torch.empty(m, n)
    gk.matmul(lib, gk.TYPES[qtype.name], x, torch.from_numpy(w), flt, bias=bias, mode=gk.FLOAT)
    tol = 2e-5 * (x.abs() @ ref_w.abs().T) + 1e-6
    assert ((flt - exact).abs() <= tol).all(), (flt - exact).abs().max()


@pytest.mark.parametrize("qtype", (Q.Q4_1, Q.Q8_0, Q.Q6_K), ids=lambda t: t.name)
def test_bf16_rows_round_once(lib, qtype):
    """bf16 activations in, bf16 out: the fp32 result of the same call rounded once to bf16."""
    k, n = 256, 21
    w = torch.from_numpy(random_weight(qtype, n, k, seed=3))
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    out16 = torch.empty(4, n, dtype=torch.bfloat16)
    out32 = torch.empty(4, n)
    gk.matmul(lib, gk.TYPES[qtype.name], x, w, out16)
    gk.matmul(lib, gk.TYPES[qtype.name], x.float(), w, out32)
    assert torch.equal(out16, out32.to(torch.bfloat16))


def test_refuses_what_it_does_not_cover(lib):
    w = torch.from_numpy(random_weight(Q.Q4_K, 4, 256))
    x = torch.randn(1, 288)  # not whole 256-value blocks
    with pytest.raises(ValueError, match="refused"):
        gk.matmul(lib, gk.TYPES["Q4_K"], x, w, torch.empty(1, 4))
    assert lib.gguf_block_values(1) == 0  # F16: not a block type of these kernels
    for name, tid in gk.TYPES.items():
        assert (lib.gguf_block_values(tid), lib.gguf_block_bytes(tid)) == GGML_QUANT_SIZES[Q[name]]
