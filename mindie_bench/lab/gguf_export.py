#!/usr/bin/env python3
"""A benchmark model as a GGUF file, made the way a llama.cpp user makes one: llama.cpp's own
``convert_hf_to_gguf.py`` (to bf16), then its ``llama-quantize`` (to Q4_K_M, Q4_0, ...). Both this
server and llama-server then read the same file (llama_server_side_by_side.sh ``--gguf``, roofline
``--model FILE``).

    python -m mindie_bench.lab.gguf_export gpu1b --llama-cpp ~/llama.cpp --type Q4_K_M

NAME is what ``bench_models`` resolves (a demo preset such as ``gpu1b``, or a Hugging Face
directory). The demo models' tokenizer is a byte-level BPE with GPT-2's pre-tokenizer split, which
the converter does not know by its hash (it knows released checkpoints'); where it does not, the
pre-tokenizer is written as ``gpt-2``, the split it uses. Nothing else of the converter is changed.
The file is written once per (model, type) into the cache and reused.
"""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("gguf_export")

# Run inside llama.cpp's source directory: the converter with the pre-tokenizer fallback.
_CONVERT = """
import sys
import conversion.base as base
known = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:  # the demo tokenizer: byte-level BPE split as GPT-2 does
        print("gguf_export: pre-tokenizer not known to the converter; writing gpt-2", file=sys.stderr)
        return "gpt-2"
base.TextModel.get_vocab_base_pre = pre
sys.argv[0] = "convert_hf_to_gguf.py"
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


def quantize_binary(llama_cpp: Path, given: str | None) -> Path:
    """llama-quantize: --llama-quantize, $LLAMA_QUANTIZE, else llama.cpp's build/bin."""
    path = Path(given or os.environ.get("LLAMA_QUANTIZE") or llama_cpp / "build" / "bin" / "llama-quantize")
    if not os.access(path, os.X_OK):
        raise SystemExit(f"gguf_export: no llama-quantize at {path} (build llama.cpp's llama-quantize target, "
                         "or pass --llama-quantize)")
    return path


def export(name: str, llama_cpp: Path, qtype: str, quantize: str | None = None, out: Path | None = None) -> Path:
    """The GGUF file of ``name`` in ``qtype`` (BF16 = the converter's output, unquantised)."""
    from mindie_bench.lab.bench_models import resolve
    from workers.models.demo import default_cache_dir
    src = Path(resolve(name))
    if not (llama_cpp / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"gguf_export: {llama_cpp} is not a llama.cpp source directory (no convert_hf_to_gguf.py)")
    qtype = qtype.upper()
    out = out or default_cache_dir() / f"gguf-export-{src.name}-{qtype}.gguf"
    if out.is_file():
        return out
    binary = None if qtype == "BF16" else quantize_binary(llama_cpp, quantize)
    tmpdir = Path(tempfile.mkdtemp(prefix="gguf-export-", dir=out.parent))
    try:
        bf16 = tmpdir / "bf16.gguf"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(llama_cpp / "gguf-py"), str(llama_cpp)]))
        log.info("converting %s to bf16 GGUF with %s", src, llama_cpp / "convert_hf_to_gguf.py")
        subprocess.run([sys.executable, "-c", _CONVERT, str(src), "--outtype", "bf16", "--outfile", str(bf16)],
                       cwd=llama_cpp, env=env, check=True)
        done = bf16
        if binary is not None:
            done = tmpdir / f"{qtype}.gguf"
            log.info("quantising to %s with %s", qtype, binary)
            subprocess.run([str(binary), str(bf16), str(done), qtype], check=True)
        done.rename(out)  # atomic: a half-written file is never taken for a finished one
    finally:
        for p in tmpdir.iterdir():
            p.unlink()
        tmpdir.rmdir()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", help="a demo preset (gpu1b, bench30m, ...) or a Hugging Face model directory")
    ap.add_argument("--llama-cpp", default=os.environ.get("LLAMA_CPP"), required="LLAMA_CPP" not in os.environ,
                    help="llama.cpp's source directory (default $LLAMA_CPP)")
    ap.add_argument("--type", default="Q4_K_M",
                    help="llama-quantize's type (Q4_K_M, Q4_0, Q4_1, Q8_0, ...), or BF16 (default Q4_K_M)")
    ap.add_argument("--llama-quantize", help="the llama-quantize binary (default $LLAMA_QUANTIZE, "
                                             "else LLAMA_CPP/build/bin/llama-quantize)")
    ap.add_argument("--out", type=Path, help="output file (default: the cache, reused once written)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    print(export(args.name, Path(args.llama_cpp).expanduser(), args.type, args.llama_quantize, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
