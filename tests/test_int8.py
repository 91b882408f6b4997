"""Weight-only int8 (``ModelConfig[].quantize: "w8a16"``, workers/backends/int8.py): the key
reaches the worker, the linears are replaced and take half the bytes of bf16 (a quarter of fp32),
the kernels match the dequantised fp32 reference per layer and over the whole model, greedy
decoding mostly agrees with the unquantised model, a backend without an int8 kernel refuses the
key at start, and nothing changes when the key is absent. The NPU kernel runs against a fake
``torch_npu`` that checks the documented contract of ``npu_weight_quant_batchmatmul``."""
from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from mindie.config import ConfigError, load_config
from mindie.contract.spec import EngineConfig, WorkerSpec, decode_spec, encode_spec
from mindie.contract.wire import SamplingParams, Submit
from mindie.topology import build_deployment
from tests.reference_attention import DenseCausalAttention
from workers.kernels import cpu_kernels
from workers.backends.cpu import CpuBackend
from workers.backends.cpu_linear import KernelLinear, PackedLinear
from workers.backends.int8 import (CpuInt8Kernel, Int8Kernel, Int8Linear, NpuInt8Kernel, copy_dequantized_into, dequantize,
                                   quantize_model, quantize_weight, weight_bytes)
from workers.engine.assembly import load_runner
from workers.models.demo import ensure_demo_model
from workers.models.loader import load_model

pytestmark = pytest.mark.timeout(300)

# Tiny random models: the demo model (tied head) and an untied one with a different shape.
TINY = {"tied": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96, max_position_embeddings=512),
        "untied": dict(hidden=96, layers=3, heads=6, kv_heads=2, intermediate=160, max_position_embeddings=512,
                       tie_word_embeddings=False, seed=3)}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("int8-models")
    return {name: str(ensure_demo_model(root, **size)) for name, size in TINY.items()}


def _spec(model: str, dtype: str = "bfloat16", quantize: str = "") -> WorkerSpec:
    return WorkerSpec(worker_id="t", job_endpoint="", pub_endpoint="", model_path=model, dtype=dtype,
                      quantize=quantize, engine=EngineConfig(block_size=16, max_seq_len=512, max_prefill_tokens=512))


def _linears(model: nn.Module) -> dict[str, nn.Module]:
    names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
    return {n: m for n, m in model.named_modules() if n.split(".")[-1] in names}


# ------------------------------------------------------------------------------------------ config


def _deploy(tmp_path: Path, model_cfg: dict):
    data = {"ServerConfig": {"runDir": str(tmp_path / "run")},
            "BackendConfig": {"deviceType": "cpu", "ModelDeployConfig": {"ModelConfig": [model_cfg]}}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return build_deployment(load_config(str(path), env={}).config)


def test_quantize_reaches_the_worker_spec(tmp_path: Path) -> None:
    assert _deploy(tmp_path, {"quantize": "w8a16"}).workers[0].quantize == "w8a16"
    assert _deploy(tmp_path, {}).workers[0].quantize == ""
    assert _deploy(tmp_path, {"quantize": None}).workers[0].quantize == ""
    spec = _deploy(tmp_path, {"quantize": "w8a16"}).workers[0]
    assert decode_spec(encode_spec(spec)).quantize == "w8a16"
    # A spec written before the field existed decodes with the default.
    old = json.loads(encode_spec(spec))
    del old["quantize"]
    assert decode_spec(json.dumps(old)).quantize == ""
    assert _deploy(tmp_path, {"quantize": "w8a8"}).workers[0].quantize == "w8a8"  # tests/test_w8a8.py
    with pytest.raises(ConfigError, match=r"ModelConfig\[0\]\.quantize: must be one of"):
        _deploy(tmp_path, {"quantize": "w4a8"})


# ------------------------------------------------------------------------------ quantisation, kernels


def test_quantisation_is_symmetric_per_output_channel() -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 40) * torch.logspace(-2, 1, 48)[:, None]  # rows of very different ranges
    w[5] = 0.0
    q, s = quantize_weight(w)
    assert q.dtype == torch.int8 and s.shape == (48,) and int(q.abs().max()) == 127
    assert torch.equal(q.abs().amax(1)[torch.arange(48) != 5], torch.full((47,), 127, dtype=torch.int8))
    assert s[5] == 1.0 and not q[5].any()
    err = (dequantize(q, s) - w).abs()
    assert bool((err <= s[:, None] / 2 + 1e-7).all())  # at most half a step per element


# The CPU kernel's two paths: its own int8 products and dequantisation over the C kernels' layout
# (the default), and torch's _weight_int8pack_mm / dequantise-then-matmul (no C kernels).
CPU_PATHS = pytest.mark.parametrize("c_kernels", [True, False], ids=["c-kernels", "torch"])


@CPU_PATHS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# both sides of CpuInt8Kernel.max_rows (24) and of CPU_INT8_KERNEL_MAX_ROWS (32)
@pytest.mark.parametrize("rows", [1, 3, 24, 25, 32, 33, 100])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_cpu_layer_matches_the_dequantised_reference(dtype, rows, bias, c_kernels) -> None:
    """One Int8Linear against x @ dequantised(W).T in fp32. Tolerance: fp32 1e-5 of the output's
    range; bf16 1/128 of it (one bf16 rounding of the output, plus the bf16 input's rounding)."""
    if c_kernels and cpu_kernels.load() is None:
        pytest.skip(f"C kernels unavailable: {cpu_kernels.unavailable_reason()}")
    torch.manual_seed(rows)
    lin = nn.Linear(96, 80, bias=bias).to(dtype)
    layer = Int8Linear(lin.weight, lin.bias, CpuInt8Kernel(c_kernels=c_kernels))
    assert ("scale16" in layer.packed_state) == c_kernels  # the path under test is the one taken
    x = torch.randn(rows, 96, dtype=dtype)
    ref = x.float() @ layer.dequantized().T + (lin.bias.detach().float() if bias else 0)
    out = layer(x)
    assert out.dtype == dtype and out.shape == (rows, 80)
    tol = (1e-5 if dtype == torch.float32 else 1 / 128) * float(ref.abs().max())
    assert float((out.float() - ref).abs().max()) <= tol
    # 3-D input (the model's [T, heads, dim] reshapes go through the same path)
    assert torch.equal(layer(x[None]).squeeze(0), out)


@CPU_PATHS
@pytest.mark.parametrize("k", [72, 101, 120])
def test_widths_the_int8pack_kernel_cannot_read(k, c_kernels) -> None:
    """torch's _weight_int8pack_mm reads K in blocks of 16 (other widths gave garbage, 101 a
    segfault): such layers take the dequantising path and still match the reference (and the C
    kernels take any width)."""
    if c_kernels and cpu_kernels.load() is None:
        pytest.skip(f"C kernels unavailable: {cpu_kernels.unavailable_reason()}")
    torch.manual_seed(k)
    layer = Int8Linear(torch.randn(40, k), None, CpuInt8Kernel(c_kernels=c_kernels))
    x = torch.randn(2, k, dtype=torch.bfloat16)
    ref = x.float() @ layer.dequantized().T
    assert float((layer(x).float() - ref).abs().max()) <= float(ref.abs().max()) / 128


@CPU_PATHS
def test_portable_kernel_matches_the_cpu_kernel(c_kernels) -> None:
    """The dequantise-then-matmul kernel (CUDA's) computes the same as the CPU's paths."""
    if c_kernels and cpu_kernels.load() is None:
        pytest.skip(f"C kernels unavailable: {cpu_kernels.unavailable_reason()}")
    torch.manual_seed(1)
    w = torch.randn(64, 32)
    cpu, portable = Int8Linear(w, None, CpuInt8Kernel(c_kernels=c_kernels)), Int8Linear(w, None, Int8Kernel())
    x = torch.randn(5, 32)
    torch.testing.assert_close(cpu(x), portable(x), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------- the loaded model


@pytest.mark.parametrize("name", list(TINY))
def test_int8_path_is_used_when_configured(tiny_models, name, monkeypatch) -> None:
    model_dir = tiny_models[name]
    calls = []
    real_mm = CpuInt8Kernel.mm
    monkeypatch.setattr(CpuInt8Kernel, "mm", lambda self, x, p: calls.append(x.shape[0]) or real_mm(self, x, p))
    runner = load_runner(_spec(model_dir, "bfloat16", "w8a16"), CpuBackend(1))
    model = runner.model
    layers = model.args.num_hidden_layers
    lin = _linears(model)
    assert all(isinstance(m, Int8Linear) for m in lin.values()) and len(lin) == 4 * layers + (name == "untied")
    assert not any(isinstance(m, (nn.Linear, PackedLinear)) for m in model.modules())
    assert isinstance(model.logits_linear if name == "tied" else model.lm_head, Int8Linear)
    assert model.embed_tokens.weight.dtype == torch.bfloat16  # the embedding stays in the model dtype
    # Memory: the quantised matrices take half their bf16 bytes (+ one scale per output row).
    int8 = [m for m in model.modules() if isinstance(m, Int8Linear)]
    q_bytes = sum(m.q.numel() + m.scale.numel() * m.scale.element_size() for m in int8)
    bf16_bytes = sum(2 * m.in_features * m.out_features for m in int8)
    assert 0.5 <= q_bytes / bf16_bytes < 0.54
    fp32 = load_runner(_spec(model_dir, "float32", "w8a16"), CpuBackend(1)).model
    fp32_int8 = [m for m in fp32.modules() if isinstance(m, Int8Linear)]
    q32 = sum(m.q.numel() + m.scale.numel() * m.scale.element_size() for m in fp32_int8)
    assert 0.25 <= q32 / sum(4 * m.in_features * m.out_features for m in fp32_int8) < 0.28
    # The whole worker's weights are smaller than the unquantised worker's.
    plain = load_runner(_spec(model_dir, "bfloat16"), CpuBackend(1)).model
    assert weight_bytes(model) < 0.8 * weight_bytes(plain)
    # ... and a step runs through the int8 kernel (every linear, the head included).
    runner.allocate_kv(64, 16)
    out = _greedy(runner, [[5, 6, 7, 8]], 2)
    # The prefill runs every int8 linear; the decode step runs the fused C step over its int8
    # copy (workers/backends/cpu_decode.py) and the head through the kernel again.
    fused = model.fast_decode
    assert fused is not None and fused.calls == 1 and fused.weights[0]["qkv_s"] is not None
    assert len(out[0]) == 2 and len(calls) == len(lin) + (name == "tied") + 1


class _NoInt8(CpuBackend):
    def int8_kernel(self):
        return None


def test_backend_without_int8_refuses_the_key(tiny_models, monkeypatch) -> None:
    loaded = []
    import workers.models.loader as loader
    real = loader.load_model
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: loaded.append(1) or real(*a, **k))
    with pytest.raises(RuntimeError, match=r'ModelConfig\[\]\.quantize \'w8a16\': the cpu backend has no '
                                           r'weight-only int8 kernel'):
        load_runner(_spec(tiny_models["tied"], "bfloat16", "w8a16"), _NoInt8(1))
    assert loaded == []  # refused before the weights are read
    with pytest.raises(ValueError, match=r"ModelConfig\[\]\.quantize: unknown scheme 'w4a16'"):
        load_runner(_spec(tiny_models["tied"], "bfloat16", "w4a16"), CpuBackend(1))
    # The same model loads on that backend without the key.
    load_runner(_spec(tiny_models["tied"], "bfloat16"), _NoInt8(1))


def _forward_logits(model: nn.Module, ids: list[int]) -> torch.Tensor:
    attn = DenseCausalAttention.from_lengths([len(ids)])
    with torch.inference_mode():
        t = torch.tensor(ids)
        return model.compute_logits(model(t, torch.arange(len(ids)), attn))


def _dequantised_reference(model_dir: str, quantised: nn.Module) -> nn.Module:
    """The unquantised fp32 model with every quantised matrix replaced by its dequantised value."""
    return copy_dequantized_into(load_model(model_dir, torch.float32, torch.device("cpu"))[0], quantised)


@pytest.mark.parametrize("name", list(TINY))
def test_whole_model_logits_match_the_dequantised_reference(tiny_models, name) -> None:
    """fp32 int8 model (int8pack for the 1-24-row head calls, dequantise-then-matmul above) against
    the fp32 model whose weights are the dequantised ones: logits within 1e-4 of their range."""
    model = load_runner(_spec(tiny_models[name], "float32", "w8a16"), CpuBackend(1)).model
    ref = _dequantised_reference(tiny_models[name], model)
    for ids in ([3 + i for i in range(40)], [7, 100, 2000, 31000, 5]):
        got, want = _forward_logits(model, ids), _forward_logits(ref, ids)
        assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())


def _greedy(runner, prompts: list[list[int]], max_new: int, num_blocks: int = 64) -> list[list[int]]:
    from workers.engine.engine import Engine
    engine = Engine(runner, EngineConfig(block_size=16, max_seq_len=512, max_prefill_tokens=512,
                                         enable_prefix_cache=False), num_blocks)
    out: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        engine.add(Submit(f"r{i}", "t", ids, SamplingParams(max_new_tokens=max_new, ignore_eos=True)))
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.seq.request_id, []).extend(o.token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_greedy_agreement_with_the_unquantised_model(tiny_models) -> None:
    """bf16 int8 against bf16, 16 prompts x 16 greedy tokens on the demo-shaped tiny model:
    positions equal until the first divergence, and teacher-forced top-1 agreement (the int8
    model's argmax on the bf16 model's own continuation). Random weights give near-flat logits,
    the hardest case for agreement; mindie_bench/lab/int8_quality.py measures more."""
    import random
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(12)] for _ in range(16)]
    runners = {}
    for q in ("", "w8a16"):
        r = load_runner(_spec(tiny_models["tied"], "bfloat16", q), CpuBackend(1))
        r.allocate_kv(128, 16)
        runners[q] = r
    base, int8 = _greedy(runners[""], prompts, 16, 128), _greedy(runners["w8a16"], prompts, 16, 128)
    forced = total = 0
    for p, b in zip(prompts, base):
        seq = p + b
        got = _forward_logits(runners["w8a16"].model, seq)[len(p) - 1:-1].argmax(-1).tolist()
        forced += sum(g == t for g, t in zip(got, b))
        total += len(b)
    same_first = sum(a[0] == b[0] for a, b in zip(base, int8))
    print(f"teacher-forced top-1 agreement {forced}/{total}, first token {same_first}/16")
    assert forced / total >= 0.8 and same_first >= 12


def test_nothing_changes_when_not_configured(tiny_models) -> None:
    """Without the key the loaded model is the one before this feature: oneDNN-packed linears (on a
    CPU where oneDNN cannot pack bf16: the C kernels' bf16 linears), no int8 module, identical
    logits with quantize "" and with the field left at its default."""
    spec = _spec(tiny_models["untied"], "bfloat16")
    assert WorkerSpec(worker_id="x", job_endpoint="", pub_endpoint="").quantize == ""
    a = load_runner(spec, CpuBackend(1)).model
    b = load_runner(WorkerSpec(worker_id="t", job_endpoint="", pub_endpoint="", model_path=spec.model_path,
                               dtype="bfloat16", engine=spec.engine), CpuBackend(1)).model
    for m in (a, b):
        assert not any(isinstance(x, Int8Linear) for x in m.modules())
        assert all(isinstance(x, (PackedLinear, KernelLinear)) for x in _linears(m).values())
    ids = [3 + i for i in range(20)]
    assert torch.equal(_forward_logits(a, ids), _forward_logits(b, ids))


# ------------------------------------------------------------------------------------------- NPU


def _fake_torch_npu(calls: list, with_op: bool = True) -> types.ModuleType:
    mod = types.ModuleType("torch_npu")

    def npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None,
                                     quant_offset=None, bias=None, antiquant_group_size=0):
        # The documented contract: x [M, K] fp16/bf16, weight int8 [K, N], antiquant_scale [N]
        # (or [1, N]) in x's dtype; y = x @ ((weight + offset) * scale) + bias, in x's dtype.
        calls.append(tuple(x.shape))
        assert x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16)
        assert weight.dtype == torch.int8 and weight.dim() == 2 and weight.shape[0] == x.shape[1]
        assert antiquant_scale.dtype == x.dtype and antiquant_scale.numel() == weight.shape[1]
        w = weight.float() * antiquant_scale.float().reshape(1, -1)
        return (x.float() @ w).to(x.dtype)

    if with_op:
        mod.npu_weight_quant_batchmatmul = npu_weight_quant_batchmatmul
    return mod


def test_npu_kernel_against_a_fake_torch_npu(monkeypatch) -> None:
    import sys
    from workers.backends.npu import NpuBackend
    calls: list = []
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu(calls))
    kernel = NpuBackend().int8_kernel()
    assert isinstance(kernel, NpuInt8Kernel)
    torch.manual_seed(2)
    lin = nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    layer = Int8Linear(lin.weight, lin.bias, kernel)
    assert layer.q.shape == (64, 48)  # stored [K, N] as the op wants
    x = torch.randn(7, 64, dtype=torch.bfloat16)
    ref = x.float() @ layer.dequantized().T + lin.bias.detach().float()
    out = layer(x)
    assert calls == [(7, 64)] and out.dtype == torch.bfloat16
    assert float((out.float() - ref).abs().max()) <= float(ref.abs().max()) / 128
    # A whole model quantises with it (CPU tensors stand in for the device's).
    model_layers = nn.ModuleDict({"layers": nn.ModuleList([nn.ModuleDict({"o_proj": nn.Linear(64, 64).bfloat16()})])})
    assert quantize_model(model_layers, kernel) == 1
    with pytest.raises(ValueError, match=r"quantize \"w8a16\" on the NPU needs a float16 or bfloat16 model"):
        Int8Linear(torch.randn(8, 8), None, kernel)


def test_npu_without_the_op_refuses_the_key(monkeypatch, tiny_models) -> None:
    import sys
    from workers.backends.npu import NpuBackend
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu([], with_op=False))
    backend = NpuBackend()
    assert backend.int8_kernel() is None
    with pytest.raises(RuntimeError, match=r"ModelConfig\[\]\.quantize 'w8a16': the npu backend has no weight-only"):
        load_runner(_spec(tiny_models["tied"], "bfloat16", "w8a16"), backend)
