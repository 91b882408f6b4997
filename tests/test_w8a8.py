"""W8A8 int8 on the CPU (issue 55 item 1): ``ModelConfig[].quantize: "w8a8"`` and pre-quantised
compressed-tensors W8A8 checkpoints, both held as GGUF Q8_0 blocks (workers/models/w8a8.py) and
computed by the GGUF block kernels with int8 activations per 32 values
(workers/backends/w8a8.py, gguf_linear.py).

Tolerances: against the same weights dequantised, the only difference is the activations' int8
rounding per 32 values, the GGUF native path's ``LOGIT_TOL`` (2 % of the logits' spread,
tests/test_gguf_kernels.py, where it is measured); greedy picks must agree wherever the
reference's top-2 margin exceeds twice that (teacher-forced: both continue from the reference's
pick). Against the float model the weights' own rounding (half a step of max|w|/127 per 32
values) adds about as much again: 4 % of the spread.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from safetensors.torch import save_file

from mindie.contract.spec import EngineConfig, WorkerSpec
from tests.test_gguf_kernels import LOGIT_TOL, _greedy_agree, _logits
from tests.tiny_hf import save_random_model
from workers.backends.cpu import CpuBackend
from workers.backends.cuda import CudaBackend
from workers.backends.gguf_linear import GgufLinear
from workers.backends.int8 import weight_bytes
from workers.engine.assembly import load_runner, start_refusal
from workers.models.config import ModelConfigError
from workers.models.loader import load_model
from workers.models.w8a8 import dequantize_q8_0, quantize_q8_0
from workers.models.w8a8_config import scheme_of

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

FLOAT_TOL = 0.04  # against the float weights: their Q8_0 rounding and the activations'
VOCAB = 160
# Qwen2: q/k/v biases; untied head (the compressed-tensors export keeps it in float: "ignore")
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# what llm-compressor writes for its W8A8 int8 scheme (the "*-quantized.w8a8" checkpoints)
W8A8_CONFIG = {
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
    "config_groups": {"group_0": {
        "targets": ["Linear"], "output_activations": None,
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False,
                    "group_size": None, "block_structure": None, "observer": "minmax"},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                              "dynamic": True, "group_size": None, "block_structure": None, "observer": None}}}}


def _spec(path: Path, quantize: str = "", dtype: str = "float32", device: str = "cpu") -> WorkerSpec:
    return WorkerSpec(worker_id="t", job_endpoint="", pub_endpoint="", model_path=str(path), dtype=dtype,
                      quantize=quantize, device_type=device,
                      engine=EngineConfig(block_size=16, max_seq_len=256, max_prefill_tokens=256))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """The float model, its compressed-tensors W8A8 export (int8 weights, per-channel scales, one
    zero point stored), and that export dequantised into a plain checkpoint (the reference)."""
    root = tmp_path_factory.mktemp("w8a8")
    hf = save_random_model("Qwen2Config", CONFIG, root / "float")
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    q8, deq = {}, dict(state)
    for name, w in state.items():
        if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
            # fp16-exact scales: the blocks store the channel's scale as fp16
            scale = (w.abs().amax(1, keepdim=True) / 127).half().float()
            q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
            q8[name], q8[name + "_scale"] = q, scale
            deq[name] = q.float() * scale
        else:
            q8[name] = w
    q8["model.layers.0.self_attn.q_proj.weight_zero_point"] = torch.zeros(CONFIG["hidden_size"], 1, dtype=torch.int8)
    cfg = json.loads((root / "float" / "config.json").read_text())
    for name, tensors, extra in (("w8a8", q8, {"quantization_config": W8A8_CONFIG}), ("dequantised", deq, {})):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps({**cfg, **extra}))
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / name / "model.safetensors"))
    return {"float": root / "float", "w8a8": root / "w8a8", "dequantised": root / "dequantised"}


def test_q8_0_blocks_are_llamas_layout() -> None:
    """The blocks decode with gguf's own Q8_0 decoder (llama.cpp's) to what this module says,
    within half a step of each block's scale of the weights."""
    w = torch.randn(5, 96, generator=torch.Generator().manual_seed(1)) * 0.1
    w[2, 32:64] = 0  # an all-zero block
    raw = quantize_q8_0(w)
    assert raw.shape == (5, 3 * 34) and raw.dtype == torch.uint8
    ours = dequantize_q8_0(raw, 96)
    assert torch.equal(ours, torch.from_numpy(gguf_dequantize(raw.numpy(), Q.Q8_0)).float())
    step = w.view(5, 3, 32).abs().amax(-1, keepdim=True) / 127
    assert ((ours - w).view(5, 3, 32).abs() <= step / 2 * 1.001 + 1e-8).all()
    assert (ours[2, 32:64] == 0).all()


def test_quantize_w8a8_against_float_and_dequantised(tiny) -> None:
    """quantize "w8a8" of a float checkpoint through the worker's assembly: every decoder linear and
    the LM head become Q8_0 GgufLinears (gate/up as two parts), their bytes a quarter of fp32's
    plus the scales; logits within FLOAT_TOL of the float model's, within LOGIT_TOL of the model
    holding the dequantised Q8_0 weights, greedy agreeing with it wherever clear; the fused decode
    step reads the blocks in place."""
    model = load_runner(_spec(tiny["float"], "w8a8"), CpuBackend(1)).model
    lins = {n: m for n, m in model.named_modules() if isinstance(m, GgufLinear)}
    assert len(lins) == 4 * CONFIG["num_hidden_layers"] + 1 and "lm_head" in lins
    assert len(lins["layers.0.mlp.gate_up_proj"].parts) == 2
    assert all(t == {8} for t in (m.types() for m in lins.values()))  # Q8_0
    fp32 = sum(m.in_features * m.out_features * 4 for m in lins.values())
    assert sum(m.nbytes() for m in lins.values()) == fp32 * 34 // 128
    embed = model.embed_tokens.weight
    assert weight_bytes(model) >= sum(m.nbytes() for m in lins.values()) + embed.numel() * embed.element_size()
    ref, _ = load_model(tiny["float"], torch.float32)
    plain = dict(ref.named_modules())
    flt, _ = load_model(tiny["float"], torch.float32)
    with torch.no_grad():
        for n, m in lins.items():
            plain[n].weight.copy_(m.weight)  # the dequantised blocks
    ids = [int(i) for i in torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(4))]
    got, want, base = _logits(model, ids), _logits(ref, ids), _logits(flt, ids)
    spread = float(want.max() - want.min())  # the logits' spread, as test_gguf_kernels measures LOGIT_TOL
    assert float((got - want).abs().max()) <= LOGIT_TOL * spread, float((got - want).abs().max()) / spread
    assert float((got - base).abs().max()) <= FLOAT_TOL * spread, float((got - base).abs().max()) / spread
    assert _greedy_agree(model, ref, ids[:6], 10) >= 3
    fused = model.fast_decode
    assert fused is not None and sum(type(v).__name__ == "CParts" for w in fused.weights for v in w.values()) == \
        5 * CONFIG["num_hidden_layers"]


def test_fused_decode_step_equals_eager_in_bf16(tiny) -> None:
    """bf16 w8a8: the fused decode step's products over the blocks are bit-identical to the eager
    GgufLinears' at 1 and 3 sequences."""
    from tests.test_cpu_decode import _decode_run
    model = load_runner(_spec(tiny["float"], "w8a8", "bfloat16"), CpuBackend(1)).model
    prompts = [[(7 * i + j) % 150 + 3 for j in range(3 + 4 * i)] for i in range(3)]
    for batch in (1, 3):
        eager, _, _, fed = _decode_run(model, torch.bfloat16, False, prompts[:batch], 5)
        fused, _, calls, _ = _decode_run(model, torch.bfloat16, True, prompts[:batch], 5, fed)
        assert calls == 5
        assert all(torch.equal(a, b) for a, b in zip(eager, fused))


def test_compressed_tensors_checkpoint_equals_transformers_dequantised(tiny) -> None:
    """A compressed-tensors W8A8 checkpoint (quantize null): its int8 values kept in Q8_0 blocks,
    every block of a row scaled by the row's weight_scale (the dequantised blocks equal q * scale
    exactly), the ignored LM head in float; logits within LOGIT_TOL of transformers computing the
    dequantised checkpoint, greedy agreeing wherever clear."""
    model = load_runner(_spec(tiny["w8a8"]), CpuBackend(1)).model
    lins = {n: m for n, m in model.named_modules() if isinstance(m, GgufLinear)}
    assert len(lins) == 4 * CONFIG["num_hidden_layers"] and not isinstance(model.lm_head, GgufLinear)
    assert len(lins["layers.0.self_attn.qkv_proj"].parts) == 3  # q, k, v as stored
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny["dequantised"], dtype=torch.float32).eval()
    with torch.no_grad():
        deq = hf.model.layers[1].mlp.down_proj.weight
        assert torch.equal(lins["layers.1.mlp.down_proj"].weight, deq)
        ids = [int(i) for i in torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(6))]
        want = hf(torch.tensor([ids])).logits[0]
    got = _logits(model, ids)
    spread = float(want.max() - want.min())
    assert float((got - want).abs().max()) <= LOGIT_TOL * spread, float((got - want).abs().max()) / spread
    ref, _ = load_model(tiny["dequantised"], torch.float32)
    assert _greedy_agree(model, ref, ids[:6], 10) >= 3


def test_refusals_name_the_key(tiny, tmp_path) -> None:
    """Schemes the kernels do not compute are refused naming quantization_config and the scheme; a
    W8A8 checkpoint with quantize w8a16 names the key; CUDA refuses "w8a8" (and a W8A8 checkpoint)
    at start, naming the key, before any weight is read."""
    import copy
    for path, value, words in ((("weights", "strategy"), "tensor", "weights strategy is 'tensor'"),
                               (("weights", "symmetric"), False, "weights symmetric is False"),
                               (("input_activations", "dynamic"), False, "input activations dynamic is False")):
        qc = copy.deepcopy(W8A8_CONFIG)
        qc["config_groups"]["group_0"][path[0]][path[1]] = value
        with pytest.raises(ModelConfigError, match=f"config.json quantization_config: .*{words}"):
            scheme_of({"quantization_config": qc})
    with pytest.raises(ModelConfigError, match="format 'pack-quantized'"):
        scheme_of({"quantization_config": {**W8A8_CONFIG, "format": "pack-quantized"}})
    assert scheme_of({"quantization_config": {"quant_method": "mxfp4"}}) is None  # other methods: left to others
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((tiny["w8a8"] / "config.json").read_text())
    cfg["quantization_config"] = {**W8A8_CONFIG, "kv_cache_scheme": {"num_bits": 8}}
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").symlink_to(tiny["w8a8"] / "model.safetensors")
    assert "quantization_config: compressed-tensors kv_cache_scheme is set" in start_refusal(_spec(bad))
    with pytest.raises(ModelConfigError, match="kv_cache_scheme"):
        load_model(bad, torch.float32)
    assert "ModelConfig[].quantize 'w8a16': the checkpoint is W8A8 already" in start_refusal(_spec(tiny["w8a8"],
                                                                                                     "w8a16"))

    class Cuda(CudaBackend):
        def unavailable(self):
            return None

    import workers.engine.assembly as assembly
    real = assembly.get_backend
    try:
        assembly.get_backend = lambda *a: Cuda()
        msg = start_refusal(_spec(tiny["float"], "w8a8", device="cuda"))
        assert msg.startswith('ModelConfig[].quantize "w8a8": the cuda backend has no W8A8 int8 kernel'), msg
        assert start_refusal(_spec(tiny["w8a8"], device="cuda")).startswith(
            "config.json quantization_config (a compressed-tensors W8A8 checkpoint): the cuda backend")
    finally:
        assembly.get_backend = real
    with pytest.raises(RuntimeError, match='quantize "w8a8": the cuda backend has no W8A8'):
        load_runner(_spec(tiny["float"], "w8a8", device="cuda"), Cuda())


def _export_w8a8(src: Path, dst: Path) -> None:
    """``src`` (a float checkpoint with its tokenizer) as a compressed-tensors W8A8 checkpoint:
    every decoder linear int8 with a per-channel scale, the head left in float ("ignore")."""
    import shutil

    from safetensors.torch import load_file
    shutil.copytree(src, dst)
    state = load_file(str(src / "model.safetensors"))
    for name, w in list(state.items()):
        if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
            w = w.float()
            scale = (w.abs().amax(1, keepdim=True) / 127).half().float()
            state[name] = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
            state[name + "_scale"] = scale
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": W8A8_CONFIG}))
    save_file({k: v.contiguous() for k, v in state.items()}, str(dst / "model.safetensors"))


def test_served_w8a8_checkpoint_answers_as_in_process(tmp_path) -> None:
    """A compressed-tensors W8A8 export of a tiny demo model (real tokenizer) through the launch
    script, quantize not set: the worker logs its W8A8 linears and the fused decode step over
    them; /infer_token's greedy tokens are the in-process model's (the same blocks) wherever its
    top-2 margin is clear (teacher-forced on the served tokens)."""
    from tests.harness import demo_server
    from tests.served import infer_ids
    from workers.backends.w8a8 import target
    from workers.models.demo import ensure_demo_model
    export = tmp_path / "w8a8"
    _export_w8a8(Path(ensure_demo_model(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96,
                                        max_position_embeddings=512)), export)
    prompt = [5, 17, 99, 230, 31, 8]
    (tmp_path / "srv").mkdir()
    with demo_server(tmp_path / "srv", str(export)) as srv:
        log = srv.tail(400)
        assert "W8A8: 8 linear layers read from the checkpoint's int8 weights" in log, log[-3000:]
        assert "fused decode kernel on" in log, log[-3000:]
        served = infer_ids(srv.url, prompt, 12)
    model, _ = load_model(export, torch.float32, w8a8=target())
    ids, clear = list(prompt), 0
    for tok in served:
        logits = _logits(model, ids)[-1]
        top = torch.topk(logits, 2).values
        if top[0] - top[1] > 2 * LOGIT_TOL * float(logits.max() - logits.min()):
            assert tok == int(logits.argmax()), (ids, tok)
            clear += 1
        ids.append(tok)
    assert clear >= 4
