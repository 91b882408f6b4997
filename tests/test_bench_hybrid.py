"""The hybrid benchmark's plumbing (mindie_bench/lab/hybrid_models.py, hybrid.py) at the toy size:
the presets are real Qwen3.5 / Qwen3 checkpoints that transformers and the engine load, built
once and found by ``mindie-bench bench-models``; ``mindie-bench hybrid`` measures both sides and
its memory figures are the engine's own."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from mindie_bench import lab  # noqa: E402
from mindie_bench.lab import hybrid_models  # noqa: E402
from workers.models.config import ModelArgs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_presets_are_real_checkpoints_built_once(tmp_path: Path) -> None:
    hybrid = hybrid_models.ensure("qwen35-tiny", tmp_path)
    twin = hybrid_models.ensure("qwen35-tiny-twin", tmp_path)
    cfg, tcfg = (json.loads((d / "config.json").read_text()) for d in (hybrid, twin))
    assert cfg["model_type"] == "qwen3_5_text" and cfg["architectures"] == ["Qwen3_5ForCausalLM"]
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert tcfg["model_type"] == "qwen3"
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size"):
        assert cfg[key] == tcfg[key], key
    tok = transformers.AutoTokenizer.from_pretrained(hybrid)
    assert len(tok) == cfg["vocab_size"] == 32000 and tok.decode(tok("hello world").input_ids[1:]) == "hello world"
    args = ModelArgs.from_dir(hybrid)  # the engine reads it as the hybrid family
    assert args.arch == "qwen3_5" and args.hybrid.linear_layers == [0, 1, 2] and args.hybrid.full_layers == [3]
    # found again without rebuilding, and by name through the CLI (same cache)
    stamp = (hybrid / "model.safetensors").stat().st_mtime_ns
    assert hybrid_models.ensure("qwen35-tiny", tmp_path) == hybrid
    assert (hybrid / "model.safetensors").stat().st_mtime_ns == stamp
    r = subprocess.run([sys.executable, "-m", "mindie_bench", "bench-models", "qwen35-tiny"], cwd=ROOT, timeout=300,
                       capture_output=True, text=True, env={**os.environ, "MINDIE_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0 and r.stdout.strip() == str(hybrid), r.stderr
    # the benchmark config on it with room for the state pool (vllm_side_by_side.sh --ours-max-batch)
    cfg_file = tmp_path / "ours.json"
    r = subprocess.run([sys.executable, "-m", "mindie_bench", "bench-models", "qwen35-tiny", "--config", str(cfg_file),
                        "--max-batch", "8"], cwd=ROOT, timeout=300, capture_output=True, text=True,
                       env={**os.environ, "MINDIE_CACHE_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    schedule = json.loads(cfg_file.read_text())["BackendConfig"]["ScheduleConfig"]
    assert (schedule["maxBatchSize"], schedule["maxPrefillBatchSize"]) == (8, 8)
    with pytest.raises(KeyError, match="qwen35-1b"):
        hybrid_models.ensure("qwen35-nope", tmp_path)


def test_hybrid_bench_measures_both_sides_with_the_engines_memory_figures(tmp_path: Path) -> None:
    import torch
    out = tmp_path / "hybrid.json"
    threads = torch.get_num_threads()
    try:
        rc = lab.run("hybrid", ["--preset", "qwen35-tiny", "--dtype", "float32", "--concurrency", "1,2",
                                "--prompt-len", "8", "--output-len", "4", "--threads", "1", "--contexts", "128,4096",
                                "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    doc = json.loads(out.read_text())
    rows = doc["results"]
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        assert r["ours_tok_s"] > 0 and r["transformers_tok_s"] > 0
        assert r["ratio"] == pytest.approx(r["ours_tok_s"] / r["transformers_tok_s"], abs=0.01)
    # the memory per sequence: the engine's own state sizes (ModelArgs) and K/V of the full layers
    args = ModelArgs.from_dir(Path(doc["model"]))
    conv, rec = args.hybrid.state_bytes(4)
    kv = len(args.hybrid.full_layers) * args.num_key_value_heads * args.head_dim * 2 * 4
    twin = ModelArgs.from_dir(Path(doc["twin"]))
    twin_kv = twin.num_hidden_layers * twin.num_key_value_heads * twin.head_dim * 2 * 4
    assert doc["bytes"]["hybrid"]["state"] == conv + rec and doc["bytes"]["hybrid"]["kv_per_token"] == kv
    assert doc["bytes"]["twin"]["kv_per_token"] == twin_kv
    assert [(m["context"], m["hybrid_bytes"], m["twin_bytes"]) for m in doc["memory"]] == [
        (n, conv + rec + kv * n, twin_kv * n) for n in (128, 4096)]
