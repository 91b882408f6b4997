"""The C kernels' bf16 products over the 16-channel layout (cpu_kernels.c ``linear_rows``), the
products of ``KernelLinear`` (workers/backends/cpu_linear.py) on CPUs where oneDNN cannot pack bf16.
AVX2 builds take a register-tiled path from ``kernels_tile_rows`` rows on (prompt chunks) and the
row path below it (decodes): both must give the torch fp32 product of the same bf16 values within
one bf16 rounding, and the same bits as each other (the same summation order), for row counts
across the threshold and across the tiled path's panels (96 rows) and block groups (16 blocks),
K across its chunks (512) and odd, N not a multiple of 16, with and without bias, 1 and 2 threads.
tests/test_cpu_isa.py runs this file against the -mno-avx512f build too."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from workers.backends.cpu_linear import KernelLinear
from workers.kernels import cpu_kernels
from workers.kernels.cpu_layout import pack

LIB = cpu_kernels.load()
pytestmark = pytest.mark.skipif(LIB is None, reason=f"C kernels unavailable: {cpu_kernels.unavailable_reason()}")
TILED = LIB is not None and LIB.has_w16a32  # builds with the tiled bf16 path (AVX2, or AVX-512 without avx512_bf16)
NEVER = 1 << 40

ROWS = [1, 2, 3, 4, 5, 7, 8, 13, 64, 95, 96, 97, 191, 600]
SHAPES = [(64, 64), (101, 112), (1100, 203), (1537, 300), (2048, 272)]  # (K, N)


@pytest.fixture
def threshold():
    """Restores the library's row threshold after a test that forces a path."""
    if not hasattr(LIB, "kernels_tile_rows"):
        pytest.skip("library without kernels_tile_rows")
    before = LIB.kernels_tile_rows(0)
    yield before
    if before > 0:
        LIB.kernels_tile_rows(before)


def _run(x: torch.Tensor, pw: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    m, k = x.shape
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    assert LIB.linear_rows(1, x.data_ptr(), m, k, pw.data_ptr(), None, n,
                           None if bias is None else bias.data_ptr(), out.data_ptr()) == 0
    return out


def _check_close(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, what) -> None:
    """Within one bf16 rounding of torch's fp32 product of the same bf16 values (plus the
    difference fp32 summation orders can make)."""
    ref = x.float() @ w.float().T + (0 if bias is None else bias.float())
    spread = x.float().abs() @ w.float().abs().T * x.shape[1] * 2 ** -23
    err = (out.float() - ref).abs()
    bound = ref.abs() * 2 ** -8 + spread + 1e-30
    assert not out.isnan().any(), what
    assert (err <= bound).all(), (what, float((err - bound).max()))


def _layer(k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random bf16 [n, k] weight, its bias and its packed layout."""
    torch.manual_seed(seed)
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    b = (torch.randn(n) * 0.1).to(torch.bfloat16)
    return w, b, pack(w)


def _each_path(run, x: torch.Tensor, pw: torch.Tensor, n: int, bias: torch.Tensor | None, threshold: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``run``'s product forced onto the tiled path, onto the row path, and at the threshold."""
    LIB.kernels_tile_rows(1)
    tiled = run(x, pw, n, bias)
    LIB.kernels_tile_rows(NEVER)
    rows = run(x, pw, n, bias)
    LIB.kernels_tile_rows(threshold)
    return tiled, rows, run(x, pw, n, bias)


@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_tiled_and_row_paths_agree_with_torch_and_each_other(k, n, threads, threshold):
    w, b, pw = _layer(k, n, k * 3 + n)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in ROWS:
            x = torch.randn(m, k).to(torch.bfloat16)
            for bias in (None, b):
                tiled, rows, default = _each_path(_run, x, pw, n, bias, threshold)
                _check_close(tiled, x, w, bias, (m, "tiled", bias is None))
                _check_close(rows, x, w, bias, (m, "rows", bias is None))
                assert torch.equal(tiled, rows), (m, bias is None)
                assert torch.equal(default, rows), (m, bias is None)
    finally:
        torch.set_num_threads(before)


def test_threshold_reports_the_build():
    """AVX2 builds and AVX-512 builds without avx512_bf16 take the tiled path from a few rows (decodes of
    1-3 rows keep the row path); builds without it (AVX512-BF16, portable) report 0 and keep their own products."""
    assert hasattr(LIB, "kernels_tile_rows")
    got = LIB.kernels_tile_rows(0)
    if TILED:
        assert 2 <= got <= 16, got
        assert LIB.kernels_tile_rows(got) == got  # setting returns the previous value
    else:
        assert got == 0


def test_tiled_rows_are_independent_of_their_neighbours(threshold):
    """A row's output depends on that row only: computed alone (row path) and inside a large
    chunk (tiled, any position in a tile or panel) it has the same bits."""
    torch.manual_seed(5)
    k, n = 777, 150
    w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
    pw = pack(w)
    x = torch.randn(203, k).to(torch.bfloat16)
    LIB.kernels_tile_rows(1)
    together = _run(x, pw, n, None)
    LIB.kernels_tile_rows(NEVER)
    for r in (0, 5, 6, 95, 96, 100, 202):
        assert torch.equal(_run(x[r:r + 1].contiguous(), pw, n, None)[0], together[r]), r


@pytest.mark.parametrize("rows", [1, 3, 4, 37, 130])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_kernel_linear_matches_torch(rows, bias):
    """The layer a bf16 model's nn.Linear becomes here: [.., K] inputs of any leading shape."""
    torch.manual_seed(rows)
    lin = nn.Linear(300, 170, bias=bias).to(torch.bfloat16)
    layer = KernelLinear(lin, LIB)
    x = torch.randn(rows, 300).to(torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 170)
    _check_close(out, x, lin.weight.detach(), lin.bias.detach() if bias else None, rows)
    assert torch.equal(layer(x.view(1, rows, 300)).view(rows, 170), out)


@pytest.mark.parametrize("cls, extra", [("LlamaConfig", dict(attention_bias=True, mlp_bias=True)),
                                        ("Qwen2Config", dict(tie_word_embeddings=True))], ids=["llama_bias", "qwen2"])
def test_bf16_model_prompt_matches_transformers(tmp_path, monkeypatch, cls, extra):
    """A bf16 model prepared as a CPU worker prepares it (its linears on these products where
    oneDNN cannot pack bf16, or on AMX CPUs) computes a 45-token prompt's logits (the tiled path: rows >= the
    threshold) within bf16's tolerance of transformers' fp32 logits on the same weights, and not
    much further from them than transformers' own bf16 forward is (as tests/test_models.py)."""
    transformers = pytest.importorskip("transformers")
    from tests.tiny_hf import save_random_model
    from workers.backends.cpu import CpuBackend
    from workers.models.loader import load_model

    config = dict(vocab_size=211, hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, **extra)
    hf = save_random_model(cls, config, tmp_path / "m")
    if getattr(LIB, "amx_rows", 0) or LIB.has_dpbf16:  # a model beyond the fused step's copy budget keeps
        # its linears as KernelLinear (AMX tiles, or AVX512-BF16 products: cpu_linear.dpbf16_linears)
        from workers import settings
        monkeypatch.setattr(settings, "_engine", settings.with_cpu(fused_decode_mb=0.01))
    backend = CpuBackend()
    model, _ = load_model(tmp_path / "m", torch.bfloat16)
    backend.prepare_model(model)
    kernel = [m for m in model.modules() if isinstance(m, KernelLinear)]
    if not kernel:
        pytest.skip("oneDNN packs bf16 on this CPU: the linears are not KernelLinear")
    a = model.args
    tokens = 45
    attn = backend.attention_class()(a.num_hidden_layers, 4, 16, a.num_key_value_heads, a.head_dim,
                                     torch.bfloat16, torch.device("cpu"))
    torch.manual_seed(4)
    ids = torch.randint(3, 211, (tokens,))
    with torch.inference_mode():
        attn.prepare([[0, 1, 2]], [0], [tokens])
        ours = model.compute_logits(model(ids, torch.arange(tokens), attn)).float()
        truth = hf(ids[None]).logits[0]
        hf_half = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.bfloat16).eval()
        hf_half.config._attn_implementation = "eager"
        hf_err = (hf_half(ids[None]).logits[0].float() - truth).abs().max().item()
    # the prompt's products took a tiled path: AVX2 register tiles, AMX tiles (AMX CPUs: cpu_linear.amx_linears),
    # or AVX512-BF16 dot products four rows at a time (cpu_linear.dpbf16_linears)
    amx = LIB.kernels_amx_rows(0) if hasattr(LIB, "kernels_amx_rows") else 0
    assert tokens >= LIB.kernels_tile_rows(0) > 0 or tokens >= amx > 0 or (amx == 0 and LIB.has_dpbf16)
    err = (ours - truth).abs().max().item()
    scale = truth.abs().max().item()
    # 8 bf16 ulps of the largest logit (tests/test_models.py: 0.0625 for logits up to ~2.5)
    assert err <= scale * 2 ** -5, (err, hf_err, scale)
    assert err <= 1.5 * hf_err + 1e-3, (err, hf_err)


AMX = LIB is not None and getattr(LIB, "amx_rows", 0) > 0  # built with AMX-BF16 and granted by the OS


@pytest.fixture
def amx_rows():
    """Restores the library's AMX row threshold after a test that forces a path."""
    if not AMX:
        pytest.skip("no AMX-BF16 tiles here (CPU without amx_bf16, or an AVX2 build)")
    before = LIB.kernels_amx_rows(0)
    yield before
    LIB.kernels_amx_rows(before)


@pytest.mark.parametrize("k, n", SHAPES + [(300, 170), (512, 170), (1024, 100), (2048, 2048)])
@pytest.mark.parametrize("threads", [1, 2])
def test_amx_tiles_agree_with_torch_and_are_row_independent(amx_rows, k, n, threads):
    """On AMX CPUs the bf16 products of the fused decode step and linear_rows take tiles of 16
    rows x 32 values of K (two row tiles by two blocks from 32 rows): within one bf16 rounding of torch's fp32 product, across row tiles (16)
    and their tails, K tails (K not a multiple of 32) and N not a multiple of 16; a row's output
    does not depend on its neighbours (alone or at any place of a batch, the same bits; past 64
    rows with K a multiple of 32 up to 1024 linear_rows takes panels of up to 512 rows through
    each block pair, bf16_panel_amx); odd K keeps the dot products (the layout's zero pad would meet a value past
    the row)."""
    w, b, pw = _layer(k, n, k + n)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.randn(1100, k).to(torch.bfloat16)
        for m in (1, 3, 15, 16, 17, 33, 64, 65, 97, 1100):
            for bias in (None, b):
                LIB.kernels_amx_rows(1)
                tiles = _run(x[:m].contiguous(), pw, n, bias)
                LIB.kernels_amx_rows(NEVER)
                dots = _run(x[:m].contiguous(), pw, n, bias)
                _check_close(tiles, x[:m], w, bias, (m, "amx", bias is None))
                _check_close(dots, x[:m], w, bias, (m, "dots", bias is None))
                if k % 2:
                    assert torch.equal(tiles, dots), m
        LIB.kernels_amx_rows(1)
        together = _run(x, pw, n, None)
        for r in (0, 5, 15, 16, 31, 63, 64, 96, 511, 512, 600, 1023, 1024, 1099):
            assert torch.equal(_run(x[r:r + 1].contiguous(), pw, n, None)[0], together[r]), r
        for a, m in ((1, 80), (30, 513), (500, 600)):  # a panel's rows as another call's
            assert torch.equal(_run(x[a:a + m].contiguous(), pw, n, None), together[a:a + m]), (a, m)
    finally:
        torch.set_num_threads(before)


def test_amx_threshold_reports_the_build():
    """The AMX row threshold is 0 exactly where the build or the OS gives no tiles, and settable."""
    flags = open("/proc/cpuinfo").read().split()
    got = LIB.kernels_amx_rows(0)
    if not (LIB.has_avx512 and LIB.has_dpbf16 and "amx_bf16" in flags):
        assert got == 0
        return
    assert 1 <= got <= 64, got  # granted on Linux 5.16 and later
    assert LIB.kernels_amx_rows(got) == got


# ---- fp32 rows over bf16 weights (linear_rows dt 2: cpu_linear.bf16_weight_linears) ----
W16A32 = LIB is not None and getattr(LIB, "has_w16a32", False)
needs_w16a32 = pytest.mark.skipif(not W16A32, reason="linear_rows without dt 2 here (AVX2 builds only)")


def _run_f32(x: torch.Tensor, pw: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    m, k = x.shape
    out = torch.full((m, n), float("nan"))
    assert LIB.linear_rows(2, x.data_ptr(), m, k, pw.data_ptr(), None, n,
                           None if bias is None else bias.data_ptr(), out.data_ptr()) == 0
    return out


@needs_w16a32
@pytest.mark.parametrize("k, n", SHAPES)
def test_fp32_rows_over_bf16_weights_agree_with_float64_and_across_paths(k, n, threshold):
    """dt 2: fp32 x, bias and out over bf16 weights, nothing rounded to bf16 but the weights: within
    fp32 summation error of the float64 product of the same values (far below one bf16 rounding,
    which bf16 activations would cost), and the tiled and row paths give the same bits."""
    w, _, pw = _layer(k, n, k * 5 + n)
    b = torch.randn(n)
    for m in (1, 2, 3, 4, 13, 97, 200):
        x = torch.randn(m, k)
        for bias in (None, b):
            tiled, rows, default = _each_path(_run_f32, x, pw, n, bias, threshold)
            ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
            bound = (x.double().abs() @ w.double().abs().T) * k * 2 ** -24 + 1e-30
            assert not tiled.isnan().any() and tiled.dtype == torch.float32
            assert ((tiled.double() - ref).abs() <= bound).all(), (m, bias is None)
            assert torch.equal(tiled, rows) and torch.equal(default, rows), (m, bias is None)


@needs_w16a32
@pytest.mark.parametrize("cls, extra", [("LlamaConfig", dict(attention_bias=True, mlp_bias=True)),
                                        ("Qwen2Config", dict(tie_word_embeddings=True))],
                         ids=["llama_bias", "qwen2_tied"])
def test_fp32_model_over_bf16_weights_matches_transformers(tmp_path, cls, extra, threshold):
    """A worker's fp32 model with ``bf16_weights`` (a GGUF file's choice on AVX2 CPUs: every linear
    and a tied head as KernelLinear over bf16 weights, fp32 activations) computes what transformers
    computes in fp32 on the same, bf16-valued weights, to fp32 rounding (bf16 activations would
    be ~2^-8 off), on a prompt (tiled path) and on greedy continuations with the row path forced;
    the fused decode step reads these layers as they are (its fp32 step over bf16 weights, code 2)."""
    pytest.importorskip("transformers")
    from tests.reference_attention import DenseCausalAttention
    from tests.tiny_hf import random_model
    from workers.backends.cpu import CpuBackend
    from workers.models.loader import load_model

    config = dict(vocab_size=211, hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, **extra)
    hf = random_model(cls, config)
    with torch.no_grad():  # the weights the layers keep, as bf16 values (the tied embedding too)
        for mod in hf.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                mod.weight.copy_(mod.weight.to(torch.bfloat16).float())
    hf.save_pretrained(tmp_path / "m", safe_serialization=True)
    backend = CpuBackend()
    backend.bf16_weights = True
    model, _ = load_model(tmp_path / "m", torch.float32)
    backend.prepare_model(model)
    kernel = [m for m in model.modules() if isinstance(m, KernelLinear)]
    assert kernel and all(m.packed.dtype == torch.bfloat16 for m in kernel)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert model.fast_decode is not None and model.fast_decode.code == 2
    assert "bf16 weights on fp32 rows" in backend.dispatch.line()
    torch.manual_seed(4)
    ids = torch.randint(3, 211, (45,)).tolist()

    def logits(seq: list[int]) -> torch.Tensor:
        t = torch.tensor(seq)
        return model.compute_logits(model(t, torch.arange(len(t)), DenseCausalAttention.from_lengths([len(t)])))

    with torch.inference_mode():
        ours, truth = logits(ids), hf(torch.tensor([ids])).logits[0]
        scale = truth.abs().max().item()
        assert (ours - truth).abs().max().item() <= scale * 2 ** -16, (ours - truth).abs().max().item()
        LIB.kernels_tile_rows(NEVER)  # every product on the row path (decodes' rows)
        rows = logits(ids)
        LIB.kernels_tile_rows(threshold)
        assert torch.equal(rows, ours)  # the same bits on either path
        seq, want = list(ids), list(ids)
        for _ in range(6):
            seq.append(int(logits(seq)[-1].argmax()))
            want.append(int(hf(torch.tensor([want])).logits[0, -1].argmax()))
        assert seq == want
