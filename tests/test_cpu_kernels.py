"""The CPU backend's C kernels (workers/kernels/cpu_kernels.c). Paged attention against the
portable torch attention: same cache contents after the write, same outputs for decodes in pure
and mixed batches, every dtype, GQA ratio, head size, block size and sliding window. RMSNorm and
rope against transformers' formulas, rounding included. The fallback to the torch code when the
kernels cannot be built or do not cover a layout."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from workers import settings
from workers.kernels import cpu_kernels
from workers.attention.cpu import CpuPagedAttention, amx_prefill_covers, prompt_route
from workers.backends.cpu_fused import CpuGemmaRMSNorm, CpuRMSNorm, CpuRotaryEmbedding
from workers.attention.paged import PagedAttention
from workers.models.config import RopeScaling
from workers.models.llama import RMSNorm, RotaryEmbedding

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(params=["kernels", "sdpa"])
def route(request, monkeypatch) -> str:
    """cpuTuning.prefillAttention set to each route."""
    monkeypatch.setattr(settings, "_engine", settings.with_cpu(prefill_attention=request.param))
    return request.param


def _pair(layers, nb, bs, hkv, d, dt, seed):
    g = torch.Generator().manual_seed(seed)
    ref = PagedAttention(layers, nb, bs, hkv, d, dt, torch.device("cpu"))
    ker = CpuPagedAttention(layers, nb, bs, hkv, d, dt, torch.device("cpu"))
    assert ker.lib is not None or d > 256, cpu_kernels.unavailable_reason()  # D > 256: torch path by design
    for a, b in zip(ref.k_cache + ref.v_cache, ker.k_cache + ker.v_cache):
        a.copy_(torch.randn(a.shape, generator=g).to(dt))
        b.copy_(a)
    return ref, ker, g


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h,hkv,d", [(8, 4, 64), (4, 4, 32), (16, 2, 128), (6, 1, 80),
                                     (16, 1, 256),  # the kernel's limits: 16 query heads per KV head, D 256
                                     (32, 1, 64), (2, 2, 320)])  # beyond them: the torch path
@pytest.mark.parametrize("bs,window", [(16, None), (128, None), (16, 7), (32, 100), (256, None), (512, 300)])
def test_decode_matches_portable(dt, h, hkv, d, bs, window):
    lens = [1, 2, 17, bs, bs + 1, 3 * bs + 5]  # context lengths incl. the new token
    nb = sum(-(-n // bs) for n in lens) + 3
    ref, ker, g = _pair(2, nb, bs, hkv, d, dt, seed=h * 1000 + d + bs)
    perm = torch.randperm(nb, generator=g).tolist()
    tables, i = [], 0
    for n in lens:
        k = -(-n // bs)
        tables.append(perm[i:i + k])
        i += k
    for a in (ref, ker):
        a.prepare(tables, [n - 1 for n in lens], [1] * len(lens))
    B = len(lens)
    q = torch.randn(B, h, d, generator=g).to(dt)
    k = torch.randn(B, hkv, d, generator=g).to(dt)
    v = torch.randn(B, hkv, d, generator=g).to(dt)
    with torch.inference_mode():
        for layer in (0, 1):
            o_ref = ref(layer, q, k, v, window)
            o_ker = ker(layer, q, k, v, window)
            assert o_ker.dtype == dt and o_ker.shape == o_ref.shape
            assert torch.equal(ref.k_cache[layer], ker.k_cache[layer])
            assert torch.equal(ref.v_cache[layer], ker.v_cache[layer])
            torch.testing.assert_close(o_ker.float(), o_ref.float(), atol=TOL[dt], rtol=TOL[dt])


def test_mismatched_shapes_never_reach_the_c_code():
    """The C write and rope trust their shapes; a mismatch takes the torch path, which raises."""
    _ref, ker, g = _pair(1, 4, 16, 2, 64, torch.float32, seed=9)
    ker.prepare([[0], [1]], [3, 5], [1, 1])
    with pytest.raises(RuntimeError):
        ker(0, torch.randn(3, 4, 64), torch.randn(3, 2, 64), torch.randn(3, 2, 64), None)  # 3 rows, 2 slots
    rope = CpuRotaryEmbedding(RotaryEmbedding(64, 128, 10000.0, None), cpu_kernels.load())
    with pytest.raises(RuntimeError):
        rope.rotate(torch.tensor([1, 2, 3]), torch.randn(2, 4, 64))  # 3 positions for 2 tokens
    with pytest.raises(RuntimeError):
        rope.rotate(torch.tensor([1, 2]), torch.randn(2, 4, 32))  # head size 32 against a table for 64


def _one_step_agrees(ref, ker, tables, start, new, q, k, v, window, dt) -> None:
    """Layer 0 of one step on both: equal caches after the write, outputs within dt's tolerance."""
    with torch.inference_mode():
        outs = []
        for a in (ref, ker):
            a.prepare(tables, start, new)
            outs.append(a(0, q, k, v, window))
    assert torch.equal(ref.k_cache[0], ker.k_cache[0]) and torch.equal(ref.v_cache[0], ker.v_cache[0])
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=TOL[dt], rtol=TOL[dt])


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_mixed_prefill_and_decode_batch(dt, route):
    """Decodes and prompt chunks (one after a cached prefix, one fresh) in one call: decodes through
    the decode kernel, chunks through the prefill kernel or SDPA one sequence at a time;
    non-contiguous k/v (slices of a fused projection, as the model passes them) are written."""
    bs, h, hkv, d = 16, 8, 2, 64
    ref, ker, g = _pair(1, 24, bs, hkv, d, dt, seed=3)
    tables = [[0, 1, 2], [3], [4, 5, 6, 7], [8, 9]]
    start = [40, 5, 20, 0]  # decode, decode, 30-token chunk after 20 cached, fresh 25-token prompt
    new = [1, 1, 30, 25]
    T = sum(new)
    qkv = torch.randn(T, (h + 2 * hkv) * d, generator=g).to(dt)
    q = qkv[:, :h * d].view(T, h, d)
    k = qkv[:, h * d:(h + hkv) * d].view(T, hkv, d)
    v = qkv[:, (h + hkv) * d:].view(T, hkv, d)
    assert not k.is_contiguous()
    _one_step_agrees(ref, ker, tables, start, new, q, k, v, None, dt)
    kernel = ker.lib.has_prefill and (dt == torch.bfloat16 and ker.lib.has_dpbf16)  # fp32 after a prefix: SDPA
    assert (ker.prefill_calls, ker.sdpa_calls) == ((int(kernel), 0) if route == "kernels" else (0, 1))


def test_batch_parallel_path_matches_single_thread():
    """Large batches take the OpenMP path: same result as computing each sequence alone."""
    bs, h, hkv, d, B = 128, 8, 4, 64, 48
    _ref, ker, g = _pair(1, 2 * B + 1, bs, hkv, d, torch.bfloat16, seed=5)
    tables = [[2 * i, 2 * i + 1] for i in range(B)]
    pos = [100 + 2 * i for i in range(B)]
    q = torch.randn(B, h, d, generator=g).to(torch.bfloat16)
    k = torch.randn(B, hkv, d, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        ker.prepare(tables, pos, [1] * B)
        together = ker(0, q, k, k, None)
        for i in range(B):
            ker.prepare([tables[i]], [pos[i]], [1])
            alone = ker(0, q[i:i + 1], k[i:i + 1], k[i:i + 1], None)
            assert torch.equal(alone[0], together[i]), f"sequence {i}"


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h,hkv,d", [(8, 4, 64), (4, 4, 32), (16, 2, 128), (32, 1, 64),  # kernel: D % 16 == 0
                                     (6, 1, 80), (64, 1, 64)])  # D 80, 64 heads per KV head: SDPA
@pytest.mark.parametrize("bs,window", [(16, None), (128, None), (16, 7), (32, 100)])
@pytest.mark.parametrize("fresh", [True, False])
def test_prefill_chunks_match_portable(dt, h, hkv, d, bs, window, fresh, route):
    """Prompt chunks through the prefill kernel (D a multiple of 16, up to 32 query heads per KV
    head, AVX-512 and AVX2 builds, fp32 and bf16) or through SDPA one sequence at a time (no
    window) equal the portable SDPA path within the dtype's tolerance: fresh prompts of 2 to 77
    tokens, chunks after a cached prefix that start and end inside blocks and cross them, beside a
    decode, with and without a sliding window. Other layouts keep the portable path."""
    start = [0, 0, 0, 0, 0, 5, 0] if fresh else [0, 0, 0, 40, 2 * bs - 3, 5, 0]
    new = [77, 2, 16, 30, 9, 1, 33]  # the 1-token entry is a decode
    nb = sum(-(-(s + n) // bs) for s, n in zip(start, new)) + 2
    ref, ker, g = _pair(1, nb, bs, hkv, d, dt, seed=h * 7 + d + bs)
    perm = torch.randperm(nb, generator=g).tolist()
    tables, i = [], 0
    for s, n in zip(start, new):
        k = -(-(s + n) // bs)
        tables.append(perm[i:i + k])
        i += k
    T = sum(new)
    q = torch.randn(T, h, d, generator=g).to(dt)
    k = torch.randn(T, hkv, d, generator=g).to(dt)
    v = torch.randn(T, hkv, d, generator=g).to(dt)
    _one_step_agrees(ref, ker, tables, start, new, q, k, v, window, dt)
    covered = (ker.lib is not None and ker.lib.has_prefill and d % 16 == 0 and h // hkv <= 32
               and dt in (torch.float32, torch.bfloat16)  # fp16 caches keep the portable path
               # plain fp32 FMAs take fresh prompts only (SDPA is faster after a prefix)
               and (fresh or dt == torch.bfloat16 and ker.lib.has_dpbf16))
    sdpa = ker.lib is not None and route == "sdpa" and window is None
    assert (ker.prefill_calls, ker.sdpa_calls) == (int(covered and not sdpa), int(sdpa)), (covered, sdpa)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h,hkv,d", [(8, 4, 64),  # 2 heads per KV head, D 64: the specialised decode items
                                     (9, 3, 80),  # 3 heads, D 80: the generic AVX-512 item, 8-lane tiles
                                     (16, 2, 256)])  # Gemma 2's head size
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("fresh", [True, False])
@pytest.mark.parametrize("mod", ["softcap", "sinks"])
def test_capped_scores_and_sinks_match_portable(dt, h, hkv, d, window, fresh, mod):
    """Gemma 2's soft-capped scores (``softcap``: cap * tanh(s / cap) before the softmax) and
    GPT-OSS's sinks (a logit per query head in every softmax's denominator) in the C kernels,
    decodes and prompt chunks, equal the portable torch path's within the dtype's tolerance, with
    a cap and sinks that change every output: a cap of 1.5 flattens scores spread about +-10 (the
    queries and keys scaled up), sinks of +-4 take a part of each softmax of scores about +-1 (bf16
    scores that large would round the portable path's bf16 products too far); the kernel without
    them is far off."""
    bs = 16
    start = [0, 0, 0, 5, 0] if fresh else [0, 40, 2 * bs - 3, 5, 0]
    new = [37, 2, 16, 1, 33]  # the 1-token entry is a decode
    nb = sum(-(-(s + n + 1) // bs) for s, n in zip(start, new)) + 2  # room for one decode step after
    ref, ker, g = _pair(1, nb, bs, hkv, d, dt, seed=h * 11 + d)
    perm = torch.randperm(nb, generator=g).tolist()
    tables, i = [], 0
    for s, n in zip(start, new):
        k = -(-(s + n + 1) // bs)
        tables.append(perm[i:i + k])
        i += k
    T = sum(new)
    up = 3 if mod == "softcap" else 1
    q, k, v = (torch.randn(T, n, d, generator=g).to(dt) * up for n in (h, hkv, hkv))
    mods = dict(softcap=1.5) if mod == "softcap" else dict(sinks=(torch.rand(h, generator=g) * 8 - 4).to(dt))
    with torch.inference_mode():
        outs = []
        for a, m in ((ref, mods), (ker, mods), (ker, {})):
            a.prepare(tables, start, new)
            outs.append(a(0, q, k, v, window, **m).float())
    torch.testing.assert_close(outs[1], outs[0], atol=TOL[dt], rtol=TOL[dt])
    assert (outs[2] - outs[0]).abs().max() > 0.1  # the cap or the sinks matter here
    covered = (ker.lib.has_prefill and dt in (torch.float32, torch.bfloat16)
               and (fresh or dt == torch.bfloat16 and ker.lib.has_dpbf16))  # as test_prefill_chunks_match_portable
    assert ker.prefill_calls == 2 * int(covered)  # the call with the cap or sinks and the one without
    # and one decode step of every sequence, through the decode kernel
    pos = [s + n for s, n in zip(start, new)]
    qd, kd, vd = (torch.randn(len(new), n, d, generator=g).to(dt) * up for n in (h, hkv, hkv))
    with torch.inference_mode():
        outs = []
        for a, m in ((ref, mods), (ker, mods), (ker, {})):
            a.prepare(tables, pos, [1] * len(new))
            outs.append(a(0, qd, kd, vd, window, **m).float())
    torch.testing.assert_close(outs[1], outs[0], atol=TOL[dt], rtol=TOL[dt])
    assert (outs[2] - outs[0]).abs().max() > 0.1


def test_sinks_of_another_head_count_are_refused():
    """The kernels read one sink logit per query head: another count is a ValueError, never a read
    past the tensor."""
    _ref, ker, g = _pair(1, 4, 16, 2, 64, torch.float32, seed=4)
    ker.prepare([[0], [1]], [3, 5], [1, 1])
    with pytest.raises(ValueError, match="3 logits for 4 query heads"):
        ker(0, torch.randn(2, 4, 64), torch.randn(2, 2, 64), torch.randn(2, 2, 64), None, sinks=torch.zeros(3))


def test_prefill_kernel_tiles_in_parallel_as_alone(monkeypatch):
    """Many prompts take the OpenMP path over (tile, KV head): each prompt's rows equal those of the
    prompt computed alone (bit for bit through the kernel; within bf16's tolerance on builds
    without it, where SDPA pads the batch)."""
    bs, h, hkv, d = 32, 8, 2, 64
    monkeypatch.setattr(settings, "_engine", settings.with_cpu(prefill_attention="kernels"))
    _ref, ker, g = _pair(1, 64, bs, hkv, d, torch.bfloat16, seed=11)
    lens = [37, 64, 5, 100, 19]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(len(lens))]
    T = sum(lens)
    q = torch.randn(T, h, d, generator=g).to(torch.bfloat16)
    k = torch.randn(T, hkv, d, generator=g).to(torch.bfloat16)
    with torch.inference_mode():
        ker.prepare(tables, [0] * len(lens), lens)
        together = ker(0, q, k, k, None)
        row = 0
        for i, n in enumerate(lens):
            ker.prepare([tables[i]], [0], [n])
            alone = ker(0, q[row:row + n], k[row:row + n], k[row:row + n], None)
            if ker.lib is not None and ker.lib.has_prefill:
                assert torch.equal(alone, together[row:row + n]), f"prompt {i}"
            else:
                torch.testing.assert_close(alone.float(), together[row:row + n].float(), atol=TOL[torch.bfloat16],
                                           rtol=TOL[torch.bfloat16])
            row += n
    assert ker.prefill_calls == (1 + len(lens) if ker.lib is not None and ker.lib.has_prefill else 0)


def test_prompt_route_is_the_key_and_refuses_other_values(monkeypatch):
    """``kernels`` by default (row-independent: a prompt gives the same bits fresh or after a
    prefix-cache hit), ``sdpa`` when asked; another value is refused naming the key."""
    assert prompt_route() == "kernels"
    monkeypatch.setattr(settings, "_engine", settings.with_cpu(prefill_attention="sdpa"))
    assert prompt_route() == "sdpa"
    monkeypatch.setattr(settings, "_engine", settings.with_cpu(prefill_attention="flash"))
    with pytest.raises(ValueError, match="cpuTuning.prefillAttention"):
        prompt_route()


@pytest.fixture(params=["amx", "avx512"])
def prefill_path(request) -> str:
    """bf16 prompt chunks through paged_prefill's AMX tiles or through its AVX-512 loops (the only
    path on CPUs without AMX, where the ``amx`` case is skipped)."""
    lib = cpu_kernels.load()
    if lib is None or not lib.has_prefill:
        pytest.skip(f"no paged_prefill in this build ({cpu_kernels.unavailable_reason() or 'no AVX-512/AVX2'})")
    if request.param == "amx" and not lib.prefill_amx:
        pytest.skip("no AMX tiles on this CPU (or the OS did not grant them)")
    before = lib.kernels_prefill_amx(int(request.param == "amx")) if lib.prefill_amx else 0
    yield request.param
    if lib.prefill_amx:
        lib.kernels_prefill_amx(before)


def _amx_calls(lib) -> int:
    return lib.kernels_prefill_amx_calls() if hasattr(lib, "kernels_prefill_amx_calls") else 0


@pytest.mark.parametrize("h,hkv,d,bs,window", [(9, 3, 64, 128, None), (8, 4, 64, 16, None), (32, 8, 64, 32, None),
                                               (9, 3, 64, 16, 7), (8, 2, 128, 32, 100), (4, 4, 32, 64, None),
                                               (6, 2, 96, 48, None)])
def test_kernel_route_gives_a_prompt_the_same_bits_fresh_and_after_a_prefix(prefill_path, h, hkv, d, bs, window):
    """Why ``kernels`` is the default: the rows of a prompt's chunk after a prefix-cache hit (a
    prefix ending anywhere in a block), or of a prompt computed in three chunks, equal, bit for
    bit, the same rows of the prompt computed fresh, on the AMX tiles and on the AVX-512 loops
    (the SDPA route does not promise it: its result for a row depends on the call's row count).
    A chunk of one token is a decode (the decode kernel's), so the prefixes leave at least two."""
    dt = torch.bfloat16
    lib = cpu_kernels.load()
    if not lib.has_dpbf16:
        pytest.skip("the kernel takes bf16 chunks after a prefix only with AVX512-BF16 (else SDPA: no such promise)")
    for n in (300, 700):
        _ref, ker, g = _pair(1, -(-n // bs) + 1, bs, hkv, d, dt, seed=n + h + d)
        q = torch.randn(n, h, d, generator=g).to(dt)
        k = torch.randn(n, hkv, d, generator=g).to(dt)
        v = torch.randn(n, hkv, d, generator=g).to(dt)
        table = list(range(-(-n // bs)))
        amx0 = _amx_calls(lib)

        def chunk(s: int, e: int) -> torch.Tensor:
            ker.prepare([table], [s], [e - s])
            return ker(0, q[s:e], k[s:e], v[s:e], window)

        with torch.inference_mode():
            fresh = chunk(0, n)
            for s in (1, 37, n // bs * bs, n - 5):
                assert torch.equal(fresh[s:], chunk(s, n)), (n, s)
            a, b = n // 3, 2 * n // 3
            parts = torch.cat([chunk(0, a), chunk(a, b), chunk(b, n)])
        assert torch.equal(fresh, parts), n
        assert ker.prefill_calls == 8
        on_tiles = prefill_path == "amx" and amx_prefill_covers(d)
        assert _amx_calls(lib) - amx0 == (8 if on_tiles else 0)


def _exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int | None) -> torch.Tensor:
    """Attention of query rows at positions start.. over keys 0.. in float64 ([n, H, D] from [L, Hkv, D])."""
    n, h, d = q.shape
    pos = torch.arange(start, start + n)[:, None]
    keys = torch.arange(k.shape[0])[None]
    mask = (keys <= pos) & ((keys > pos - window) if window else True)
    g = h // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), kk) * d ** -0.5
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hnl,lhd->nhd", p, vv)


@pytest.mark.parametrize("h,hkv,d,bs,window", [(8, 4, 64, 128, None), (9, 3, 64, 16, None), (8, 2, 128, 32, 50),
                                               (4, 4, 32, 64, None), (6, 2, 96, 16, None),
                                               (6, 1, 80, 16, None), (4, 2, 256, 16, None)])  # not on the tiles
def test_prefill_paths_round_as_the_exact_attention(prefill_path, h, hkv, d, bs, window):
    """bf16 prompt chunks (one fresh, one after a cached prefix, in one call) against float64
    attention of the same bf16 inputs: every output within one bf16 step of the exact value (2^-17
    near zero), and at least 99 % of them the exact value rounded (the AMX tiles carry the
    probabilities as two bf16 terms, so they lose nothing a single bf16 would). Head sizes the tiles do not take (not a
    multiple of 32, above 128) run the AVX-512 loops whatever the switch says."""
    dt = torch.bfloat16
    lib = cpu_kernels.load()
    if not lib.has_dpbf16:
        pytest.skip("bf16 chunks after a prefix take the kernel only with AVX512-BF16")
    lens, starts = [150, 90], [0, 70]
    per = [-(-(s + n) // bs) for s, n in zip(starts, lens)]
    _ref, ker, g = _pair(1, sum(per), bs, hkv, d, dt, seed=d + bs)
    tables = [list(range(per[0])), list(range(per[0], sum(per)))]
    qs = [2 * torch.randn(n, h, d, generator=g).to(dt) for n in lens]  # sharper softmax than unit scores
    ks = [torch.randn(s + n, hkv, d, generator=g).to(dt) for s, n in zip(starts, lens)]
    vs = [torch.randn(s + n, hkv, d, generator=g).to(dt) for s, n in zip(starts, lens)]
    amx0 = _amx_calls(lib)
    with torch.inference_mode():
        # the second sequence's prefix: written by a first chunk
        ker.prepare([tables[1]], [0], [starts[1]])
        ker(0, torch.zeros(starts[1], h, d, dtype=dt), ks[1][:starts[1]], vs[1][:starts[1]], window)
        ker.prepare(tables, starts, lens)
        out = ker(0, torch.cat(qs), torch.cat([k[s:] for k, s in zip(ks, starts)]),
                  torch.cat([v[s:] for v, s in zip(vs, starts)]), window)
    exact = torch.cat([_exact_attention(q, k, v, s, window) for q, k, v, s in zip(qs, ks, vs, starts)])
    # one bf16 step at the exact value's magnitude; near 0 (terms of size ~1 cancelling) 2^-17,
    # the precision of the probabilities' two bf16 terms
    step = (exact.abs() * 2.0 ** -7).clamp_min(2.0 ** -17)
    assert ((out.double() - exact).abs() <= step).all()
    rounded = (out == exact.to(dt)).double().mean().item()
    assert rounded >= 0.99, rounded
    on_tiles = prefill_path == "amx" and amx_prefill_covers(d)
    assert _amx_calls(lib) - amx0 == (2 if on_tiles else 0)


def _run_fresh(code: str, **env) -> str:
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env})
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


PROBE = ("from workers.backends.cpu import CpuBackend; from workers.kernels import cpu_kernels; "
         "print(CpuBackend().attention_class().__name__, '|', cpu_kernels.unavailable_reason())")
# The same, and the file of the library the fresh process loaded.
PROBE_FILE = ("from workers.backends.cpu import CpuBackend; from workers.kernels import cpu_kernels; "
              "print(CpuBackend().attention_class().__name__, '|', cpu_kernels.unavailable_reason(), '|', "
              "getattr(cpu_kernels.load(), '_name', None))")


def _place_this_build(d) -> str:
    """A copy of this process's kernel library in directory ``d`` (made private, as the loader
    requires), under its own name: the name is the key of the source, compiler, CPU flags and build
    flags, so a fresh process with this environment computes it and loads the file without a compile
    (~6 CPU-s saved per test). That the compile itself works is proven wherever a cache starts
    empty: tests/test_cpu_isa.py builds into fresh cache dirs every run, and so does every test
    process on a clean machine (CI)."""
    import shutil
    lib = cpu_kernels.load()
    assert lib is not None, cpu_kernels.unavailable_reason()
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return shutil.copy2(lib._name, d)


def test_cpu_backend_uses_kernels_when_built(tmp_path):
    """A fresh process with MINDIE_KERNEL_CACHE pointing at a cache that holds the build finds it
    there (its key computed alike: no second build) and the CPU backend takes the kernels'
    attention."""
    placed = _place_this_build(tmp_path)
    name, why, loaded = (s.strip() for s in _run_fresh(PROBE_FILE, MINDIE_KERNEL_CACHE=str(tmp_path)).split("|"))
    assert name == "CpuPagedAttention", (name, why)
    assert loaded == placed, f"loaded {loaded}, not the cached {placed}"
    assert [str(f) for f in tmp_path.glob("cpu_kernels-*.so")] == [placed], "a second build beside the cached one"


def test_unwritable_cache_dir_falls_back_to_the_temp_dir(tmp_path):
    """A cache dir that cannot be created (a read-only home) falls back to the private directory
    under the temp dir: the library is looked for (and built) there."""
    placed = _place_this_build(tmp_path / f"mindie-py-kernels-{os.getuid()}")
    name, why, loaded = (s.strip() for s in _run_fresh(PROBE_FILE, MINDIE_KERNEL_CACHE="/proc/no-such-dir",
                                                       TMPDIR=str(tmp_path)).split("|"))
    assert name == "CpuPagedAttention", (name, why)
    assert loaded == placed, f"loaded {loaded}, not the one in the temp dir's cache {placed}"


@pytest.mark.parametrize("env,reason", [({"MINDIE_CPU_KERNELS": "0"}, "disabled by cpuTuning.kernels (MINDIE_CPU_KERNELS)"),
                                        ({"CC": "false"}, "build failed"),
                                        ({"CC": "/nonexistent/cc"}, "no C compiler")])
def test_falls_back_to_portable_attention(tmp_path, env, reason):
    out = _run_fresh(PROBE, MINDIE_KERNEL_CACHE=str(tmp_path), **env)
    name, why = (s.strip() for s in out.split("|"))
    assert name == "PagedAttention"
    assert why.startswith(reason), why


# -- RMSNorm and rope --------------------------------------------------------------------------
def _hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _hf_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one tensor [T, H, D]; cos/sin [T, D/2] fp32."""
    c = torch.cat((cos, cos), -1).to(x.dtype)[:, None]
    s = torch.cat((sin, sin), -1).to(x.dtype)[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * c + torch.cat((-x2, x1), dim=-1) * s


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,c", [(1, 512), (7, 96), (300, 1024)])
def test_rms_norm_matches_transformers(dt, rows, c):
    g = torch.Generator().manual_seed(rows * c)
    norm = RMSNorm(c, 1e-6, dt)
    norm.weight.data.copy_((1 + 0.1 * torch.randn(c, generator=g)).to(dt))
    fused = CpuRMSNorm(norm, cpu_kernels.load())
    base = (3 * torch.randn(rows, c + 40, generator=g)).to(dt)
    for x in (base[:, :c], base[:, :c].contiguous().view(rows, 1, c)):  # strided rows, 3-D contiguous
        with torch.inference_mode():
            got = fused(x)
        ref = _hf_rms_norm(x, norm.weight, 1e-6)
        assert got.shape == x.shape and got.dtype == dt
        # fp32 sums in another order may move a value across one rounding boundary, no more.
        ulp = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dt]
        torch.testing.assert_close(got.float(), ref.float(), rtol=ulp, atol=ulp)
        if dt != torch.float32:  # in fp32 the sum order shows in the last bit
            assert (got == ref).float().mean() > 0.99


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,c", [(1, 640), (7, 256), (300, 1152)])
def test_gemma_rms_norm_matches_transformers(dt, rows, c):
    """Gemma's norm (scaled by 1 + w in fp32, one rounding) in one C kernel against transformers'
    Gemma3RMSNorm arithmetic (GemmaRMSNorm's torch code): rows of a wider tensor, 3-D rows, and the
    q/k norms' layout (heads of a token inside the fused projection's row: copied into place)."""
    from workers.models.gemma import GemmaRMSNorm
    g = torch.Generator().manual_seed(rows * c)
    norm = GemmaRMSNorm(c, 1e-6, dt)
    norm.weight.data.copy_((0.3 * torch.randn(c, generator=g)).to(dt))
    fused = CpuGemmaRMSNorm(norm, cpu_kernels.load())
    base = (3 * torch.randn(rows, 4 * c + 40, generator=g)).to(dt)
    for x in (base[:, :c], base[:, :c].contiguous().view(rows, 1, c), base[:, :4 * c].view(rows, 4, c)):
        with torch.inference_mode():
            got, ref = fused(x), norm(x)
        assert got.shape == x.shape and got.dtype == dt
        ulp = {torch.float32: 1e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}[dt]
        torch.testing.assert_close(got.float(), ref.float(), rtol=ulp, atol=ulp)
        if dt != torch.float32:
            assert (got == ref).float().mean() > 0.99


def test_rms_norm_falls_back_on_layouts_it_does_not_cover():
    norm = RMSNorm(64, 1e-5, torch.bfloat16)
    fused = CpuRMSNorm(norm, cpu_kernels.load())
    x = torch.randn(5, 8, 64 * 3).to(torch.bfloat16)[:, :, :64]  # 3-D, not contiguous
    torch.testing.assert_close(fused(x), norm(x), rtol=0, atol=0)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 80])
def test_rope_in_place_is_exactly_transformers(dt, d):
    g = torch.Generator().manual_seed(d)
    scaling = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192) if d == 128 else None
    rope = RotaryEmbedding(d, 4096, 500000.0 if scaling else 10000.0, scaling)
    fused = CpuRotaryEmbedding(rope, cpu_kernels.load())
    t, h, hkv = 9, 4, 2
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=g).to(dt)
    before = qkv.clone()
    pos = torch.tensor([0, 1, 2, 100, 101, 2000, 4095, 7, 3000])
    qk = qkv[:, :(h + hkv) * d].view(t, h + hkv, d)
    ref = _hf_rope(qk.clone(), rope.cos[pos], rope.sin[pos])
    with torch.inference_mode():
        out = fused.rotate(pos, qk)
    assert out.data_ptr() == qkv.data_ptr()  # rotated in place
    assert torch.equal(out, ref)
    assert torch.equal(qkv[:, (h + hkv) * d:], before[:, (h + hkv) * d:])  # v untouched
    with pytest.raises(IndexError, match="outside the table"):
        fused.rotate(torch.tensor([4096]), torch.randn(1, 1, d).to(dt))


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float32])
def test_specialised_decode_items_give_the_generic_items_bits(dt):
    """AVX-512 builds decode the common shapes (1, 2 or 4 query heads per KV head with head size 64
    or 128, 8 with 64) with items specialised by shape and a vector chunk maximum; switched off,
    the kernel computes as before them. They must form every sum as before: the same bits, over
    GQA ratios, head sizes, block sizes, windows, contexts up to 1000, and scores with inf and NaN."""
    lib = cpu_kernels.load()
    assert lib is not None, cpu_kernels.unavailable_reason()
    if not lib.has_avx512:
        pytest.skip("an AVX2 build has only the portable item")  # the AVX2 run of test_cpu_isa covers it
    cases = 0
    for h, hkv, d in ((8, 4, 64), (4, 4, 64), (16, 4, 64), (32, 4, 64), (8, 8, 128), (8, 4, 128), (16, 4, 128)):
        assert lib.kernels_decode_specialised_for(1 if dt == torch.bfloat16 else 0, h, hkv, d) == 1
        for bs, window in ((16, None), (128, None), (16, 7), (128, 100)):
            lens = [1, 2, 17, bs, bs + 1, 3 * bs + 5, 1000]
            nb = sum(-(-n // bs) for n in lens) + 3
            _ref, ker, g = _pair(1, nb, bs, hkv, d, dt, seed=h * 100 + d + bs)
            perm = torch.randperm(nb, generator=g).tolist()
            tables, i = [], 0
            for n in lens:
                tables.append(perm[i:i + -(-n // bs)])
                i += -(-n // bs)
            if window is None:  # the longest sequence's last block: an inf key row and a NaN one
                last = tables[-1][-1]
                ker.k_cache[0][last, 0, 1] = float("inf")
                ker.k_cache[0][last, 0, 3, 5] = float("nan")
            ker.prepare(tables, [n - 1 for n in lens], [1] * len(lens))
            q = (torch.randn(len(lens), h, d, generator=g) * 3).to(dt)
            outs = []
            was = lib.kernels_decode_specialised(1)
            try:
                for on in (1, 0):
                    lib.kernels_decode_specialised(on)
                    assert lib.kernels_decode_specialised_for(1 if dt == torch.bfloat16 else 0, h, hkv, d) == on
                    outs.append(ker._decode(ker.meta.decode, q, ker.k_cache[0], ker.v_cache[0], window))
            finally:
                lib.kernels_decode_specialised(was)
            bits = torch.int16 if dt == torch.bfloat16 else torch.int32  # NaN outputs compare by their bits
            assert torch.equal(outs[0].view(bits), outs[1].view(bits)), (h, hkv, d, bs, window)
            cases += 1
    assert cases == 28 and lib.kernels_decode_specialised(-1) == 1
    assert lib.kernels_decode_specialised_for(1, 12, 4, 64) == 0 and lib.kernels_decode_specialised_for(2, 8, 4, 64) == 0


def test_swiglu_kernel_equals_torch_bit_for_bit():
    """The bf16 SwiGLU kernel (the MLP's silu(gate) * up in one pass) gives torch's bits for every
    row count, strided rows (a slice of a wider projection), infinities, NaN and signed zeros;
    fp32 activations keep torch's own code."""
    from workers.backends.cpu_fused import CpuSwiGLU
    from workers.models.config import ModelArgs
    from workers.models.llama import MLP
    lib = cpu_kernels.load()
    mlp = MLP(ModelArgs(arch="llama", vocab_size=8, hidden_size=16, intermediate_size=37, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2, head_dim=8), torch.bfloat16)
    fused = CpuSwiGLU(mlp, lib)
    g = torch.Generator().manual_seed(4)
    for rows in (1, 5, 300):
        wide = (torch.randn(rows, 2 * 37 + 3, generator=g) * 6).to(torch.bfloat16)
        wide[0, :6] = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-40])
        wide[-1, 37:41] = torch.tensor([float("nan"), float("inf"), -0.0, 3.0])
        for gate_up in (wide[:, :74], wide[:, :74].contiguous()):
            want = mlp.swiglu(gate_up)
            got = fused(gate_up)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, 37)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), rows
    x = torch.randn(4, 74)
    assert torch.equal(fused(x), mlp.swiglu(x))  # fp32: torch's path


def test_sdpa_route_takes_a_long_chunk_after_a_prefix_in_pieces(monkeypatch):
    """A prompt chunk longer than MASK_ROWS after a cached prefix goes through SDPA a piece of
    query rows at a time (no n x (s + n) mask): the same result as the portable path, and as the
    kernel, across piece edges."""
    from workers.attention import cpu as cpu_attention
    monkeypatch.setattr(settings, "_engine", settings.with_cpu(prefill_attention="sdpa"))
    monkeypatch.setattr(cpu_attention, "MASK_ROWS", 24)
    bs, h, hkv, d, dt = 16, 4, 2, 64, torch.bfloat16
    ref, ker, g = _pair(1, 16, bs, hkv, d, dt, seed=21)
    start, new = [37, 0], [70, 20]  # 70 rows in pieces of 24, 24, 22; a fresh prompt beside
    tables = [list(range(0, 7)), list(range(7, 9))]
    T = sum(new)
    q = torch.randn(T, h, d, generator=g).to(dt)
    k = torch.randn(T, hkv, d, generator=g).to(dt)
    v = torch.randn(T, hkv, d, generator=g).to(dt)
    _one_step_agrees(ref, ker, tables, start, new, q, k, v, None, dt)
    assert (ker.sdpa_calls, ker.prefill_calls) == (1, 0)
    assert ker._seqs[0][4] is None and ker._seqs[1][3] is None  # no whole mask kept; the fresh one needs none
