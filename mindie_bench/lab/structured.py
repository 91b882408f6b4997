#!/usr/bin/env python3
"""What structured output costs (issue 29, point 7): constrained decoding in the device worker.

1. **Compile**: a large JSON schema (``--large-props`` properties: nested objects, enums, patterns,
   arrays of objects) compiled by the worker's own compiler (``workers.engine.constraints.Grammars``
   over the model's tokenizer.json) cold, median of ``--compiles`` schemas differing in one title,
   and cached (the same schema again: the cache lookup, the request's matcher copied, its first mask).
2. **Jump-forward** (engine in this process, as ``mindie-bench engine`` runs it): a schema with long
   fixed keys, greedy, ``--jf-requests`` requests at once and one alone, with ``jumpForward`` on and
   off alternated for ``--rounds``: model steps, tokens, wall time (median); the tokens must be the same.
3. **Tokens/s over HTTP** (the real server, ``scripts/launch.sh`` through ``serving.start_server``):
   streamed ``/v1/completions`` at each ``--concurrency`` level, every request constrained by a
   realistic schema (``response_format`` json_schema, greedy, ending where the schema completes)
   against none (the same prompts, ``ignore_eos``, each as long as its constrained answer was),
   alternated for ``--rounds``; once with jump-forward on (the default) and once off (the masks'
   cost alone). Output tokens are the server's counts.

    python -m mindie_bench.lab.structured                       # the random demo model
    python -m mindie_bench.lab.structured --model default       # SmolLM2-135M-Instruct (its GGUF)
    python -m mindie_bench.lab.structured --model DIR --concurrency 1,32 --rounds 2

Also ``mindie-bench structured ...`` (mindie_bench/lab/__init__.py lists the lab's commands). Engine
internals for parts 1 and 2, because the worker's compiler and step count are what they measure
(``workers.engine.constraints``, ``workers.engine.engine``, the runner from ``mindie_bench.lab.engine.load``);
part 3 talks HTTP only. The figures are in docs/performance.md, "Structured output".
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

# A realistic record (what an application asks for): bounded values, so that even a random model's
# noise ends within the output budget.
ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{6}$"},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 16},
            "email": {"type": "string", "maxLength": 24},
            "tier": {"enum": ["basic", "silver", "gold"]}},
            "required": ["name", "email", "tier"], "additionalProperties": False},
        "items": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 8},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
            "unit_price": {"type": "number", "minimum": 0, "maximum": 10000}},
            "required": ["sku", "quantity", "unit_price"], "additionalProperties": False}},
        "express": {"type": "boolean"},
        "notes": {"type": "string", "maxLength": 20},
    },
    "required": ["order_id", "customer", "items", "express", "notes"],
    "additionalProperties": False,
}

# Long fixed keys, short bounded values: most of the output is forced text.
LONG_KEYS = {
    "type": "object",
    "properties": {
        "customer_account_identifier": {"type": "string", "maxLength": 6},
        "shipping_address_postal_code_verified": {"type": "boolean"},
        "estimated_delivery_window_in_business_days": {"type": "integer", "minimum": 1, "maximum": 30},
        "preferred_notification_channel_for_updates": {"enum": ["email", "sms", "none"]},
        "requires_signature_upon_delivery_confirmation": {"type": "boolean"},
    },
    "required": ["customer_account_identifier", "shipping_address_postal_code_verified",
                 "estimated_delivery_window_in_business_days", "preferred_notification_channel_for_updates",
                 "requires_signature_upon_delivery_confirmation"],
    "additionalProperties": False,
}


def large_schema(props: int, title: str = "large") -> dict:
    """A large schema of ``props`` top-level properties cycling through the features real schemas
    use (nested objects, enums of 12 values, patterns, bounded numbers, arrays of objects, anyOf)."""
    out: dict = {}
    for i in range(props):
        k = i % 6
        if k == 0:
            s = {"type": "object", "properties": {f"field_{i}_{j}": {"type": "string", "maxLength": 32} for j in range(4)},
                 "required": [f"field_{i}_0"], "additionalProperties": False}
        elif k == 1:
            s = {"enum": [f"value_{i}_{j}" for j in range(12)]}
        elif k == 2:
            s = {"type": "string", "pattern": f"^[A-Z]{{3}}-[0-9]{{{2 + i % 4}}}$"}
        elif k == 3:
            s = {"type": "integer", "minimum": -i, "maximum": 1000 + i}
        elif k == 4:
            s = {"type": "array", "maxItems": 5, "items": {"type": "object", "properties": {
                "name": {"type": "string"}, "score": {"type": "number"}}, "required": ["name"]}}
        else:
            s = {"anyOf": [{"type": "null"}, {"type": "boolean"}, {"type": "string", "format": "date"}]}
        out[f"property_number_{i}"] = s
    return {"title": title, "type": "object", "properties": out, "required": list(out)[: props // 2],
            "additionalProperties": False}


def model_dir_of(model: str) -> tuple[str, str]:
    """(what the server is given, the directory with its tokenizer.json): a GGUF file is served
    through its model view."""
    if model == "default":
        from workers.models.default_model import default_model_file
        model = str(default_model_file())
    if model.endswith(".gguf"):
        from workers.models.gguf_view import ensure_view
        return model, str(ensure_view(Path(model)))
    return model, model


# -- 1. compile ------------------------------------------------------------------------------------

def compile_times(model_dir: str, vocab: int, eos, props: int, n: int) -> dict:
    from mindie.contract.wire import Constraint
    from workers.engine.constraints import Grammars, MaskJob

    t0 = time.perf_counter()
    g = Grammars(model_dir, vocab, eos)
    g.tokenizer()
    tok_s = time.perf_counter() - t0

    def once(spec: str) -> tuple[float, float]:
        t = time.perf_counter()
        fut = g.compile(Constraint("json_schema", spec))
        tmpl = fut.result()
        compiled = time.perf_counter() - t
        st = g.state(tmpl)
        MaskJob(g, [st]).wait()
        return compiled, time.perf_counter() - t

    cold, cold_mask, cached = [], [], []
    for i in range(n):
        spec = json.dumps(large_schema(props, f"large {i}"))
        c, m = once(spec)
        cold.append(c)
        cold_mask.append(m)
        cached.append(once(spec)[1])
    spec_len = len(json.dumps(large_schema(props)))
    g.close()
    return {"tokenizer_s": tok_s, "schema_chars": spec_len, "props": props, "cold_compile_ms": med(cold) * 1e3,
            "cold_first_mask_ms": med(cold_mask) * 1e3, "cached_first_mask_ms": med(cached) * 1e3,
            "cold_all_ms": [round(x * 1e3, 2) for x in cold_mask]}


# -- 2. jump-forward -----------------------------------------------------------------------------

def jump_forward(runner, cfg, num_blocks: int, model_dir: str, prompts: list[list[int]], max_new: int,
                 rounds: int) -> dict:
    """Steps, tokens and seconds (median of ``rounds``, on and off alternated) of one request alone
    and of ``prompts`` at once, with jump-forward on and off."""
    import msgspec

    from mindie.contract.wire import Constraint, SamplingParams, Submit
    from workers.engine.constraints import Grammars
    from workers.engine.engine import Engine

    c = Constraint("json_schema", json.dumps(LONG_KEYS))
    engines = {}
    for jf in (True, False):
        eng = engines[jf] = Engine(runner, msgspec.structs.replace(cfg, jump_forward=jf), num_blocks)
        eng.grammars = Grammars(model_dir, runner.vocab_size, runner.eos_token_ids)
        # warm: the grammar compiled and cached, one-time costs paid
        eng.add(Submit("warm", "b", prompts[0], SamplingParams(max_new_tokens=4, constraint=c)))
        while eng.has_work() or eng.grammar_busy:
            eng.step()
    rows: dict = {}
    n = 0
    for _ in range(max(1, rounds)):  # alternated, so that a busy spell of the machine hits both sides
        for batch in ("alone", "batch"):
            for jf in (True, False):
                eng = engines[jf]
                group = prompts[:1] if batch == "alone" else prompts
                steps0, forced0 = eng.steps, eng.forced_tokens
                outs: dict[int, list[int]] = {}
                t0 = time.perf_counter()
                for i, p in enumerate(group):
                    n += 1
                    eng.add(Submit(f"r{n}", "b", p, SamplingParams(max_new_tokens=max_new, constraint=c)))
                    outs[n] = []
                while eng.has_work() or eng.grammar_busy:
                    for o in eng.step():
                        outs[int(o.seq.request_id[1:])] += o.token_ids
                dt = time.perf_counter() - t0
                r = rows.setdefault((jf, batch), {"steps": eng.steps - steps0, "tokens": sum(map(len, outs.values())),
                                                  "forced": eng.forced_tokens - forced0, "all_s": [],
                                                  "outs": list(outs.values())})
                r["all_s"].append(round(dt, 3))
                r["same"] = r["outs"] == list(outs.values())
    for eng in engines.values():
        eng.close()
    same = all(rows[(True, b)]["outs"] == rows[(False, b)]["outs"] and rows[(True, b)]["same"]
               for b in ("alone", "batch"))
    for r in rows.values():
        r["seconds"] = med(r["all_s"])
        r.pop("outs")
    return {"same_tokens": same, **{f"{'on' if jf else 'off'}/{b}": r for (jf, b), r in rows.items()}}


# -- 3. tokens/s over HTTP ------------------------------------------------------------------------

def http_tokens(model: str, dtype: str, port: int, levels: list[int], rounds: int, jf: bool, max_new: int,
                prompt_len: int, threads: int) -> dict:
    from mindie_bench.api_clients import OpenAIAdapter
    from mindie_bench.lab.serving import start_server
    from mindie_bench.runner import LoadConfig, run_async, run_segment
    from mindie_bench.workload import make_workload

    server, url, ready_s = start_server(model, port, workers=1, dtype=dtype, prefix="sb",
                                        schedule={"jumpForward": jf}, backend={"cpuThreadsPerWorker": threads})
    fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}}}
    rows: dict[int, dict[str, list[dict]]] = {c: {"constrained": [], "none": []} for c in levels}
    try:
        async def measure() -> None:
            for c in levels:
                n = max(4, c) if c > 1 else 4
                cfg = LoadConfig(concurrency=c, num_prompts=n, warmup=min(4, c), progress=False)
                for r in range(rounds):
                    wl = make_workload(prompt_len=str(prompt_len), output_len=str(max_new))
                    seg = await run_segment(OpenAIAdapter(url, model="bench", ignore_eos=False, extra=fmt), wl, cfg,
                                            f"constrained c={c} round {r + 1}")
                    rows[c]["constrained"].append(seg.stats)
                    bad = [x for x in seg.results if x.error or not x.ok]
                    if bad:
                        raise SystemExit(f"constrained requests failed: {bad[0].error}")
                    # each prompt's free twin generates as many tokens as its constrained answer had
                    # (the batch thins out alike), ignoring EOS
                    lengths = {x.index: max(1, x.output_tokens) for x in seg.results}
                    mean = max(1, round(seg.stats["total_output_tokens"] / max(1, seg.stats["completed"])))

                    def twins(n: int, seed: int, wl=wl, lengths=lengths, mean=mean):
                        return [dataclasses.replace(sp, output_len=lengths.get(sp.index, mean)) for sp in wl(n, seed)]

                    seg = await run_segment(OpenAIAdapter(url, model="bench", ignore_eos=True), twins, cfg,
                                            f"none c={c} round {r + 1}")
                    rows[c]["none"].append(seg.stats)

        run_async(measure())
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    return {"ready_s": ready_s, "rows": rows}


def med(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model dir or GGUF file (default: the random demo model; "
                                              "'default': the default model, SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=0, help="cpuThreadsPerWorker of the server (0: the cores)")
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=256, help="max_tokens of every request")
    ap.add_argument("--large-props", type=int, default=300)
    ap.add_argument("--compiles", type=int, default=5, help="cold compiles (distinct schemas), median")
    ap.add_argument("--jf-requests", type=int, default=8)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: compile, jump, http")
    ap.add_argument("--port", type=int, default=18740)
    ap.add_argument("--out", default="bench-results/structured")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from mindie_bench.lab.engine import load

    served, model_dir = model_dir_of(args.model) if args.model else ("", "")
    runner, cfg, num_blocks = load(model_dir, args.dtype)
    if not served:
        from mindie_bench.lab import demo_model
        served = model_dir = demo_model()
    doc: dict = {"args": vars(args), "model": served}
    print(f"model {served} ({args.dtype})", file=sys.stderr)

    if "compile" not in skip:
        doc["compile"] = r = compile_times(model_dir, runner.vocab_size, runner.eos_token_ids, args.large_props,
                                           args.compiles)
        print(f"\ncompile: llguidance tokenizer from tokenizer.json {r['tokenizer_s']:.2f} s (once per worker); "
              f"a {r['props']}-property schema ({r['schema_chars']} chars): cold compile {r['cold_compile_ms']:.1f} ms, "
              f"+ first mask {r['cold_first_mask_ms']:.1f} ms; cached (lookup, copy, first mask) "
              f"{r['cached_first_mask_ms']:.2f} ms (medians of {args.compiles})")

    if "jump" not in skip:
        rng = random.Random(0)
        if args.model:  # a chat model: ask for the record in its template where it has one
            from tokenizers import Tokenizer
            tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
            qs = [f"<|im_start|>user\nWrite delivery record number {i} as JSON.<|im_end|>\n<|im_start|>assistant\n"
                  for i in range(args.jf_requests)]
            prompts = [tok.encode(q, add_special_tokens=False).ids for q in qs]
        else:
            prompts = [[rng.randrange(3, runner.vocab_size) for _ in range(args.prompt_len)]
                       for _ in range(args.jf_requests)]
        doc["jump"] = j = jump_forward(runner, cfg, num_blocks, model_dir, prompts, args.max_new, args.rounds)
        print(f"\njump-forward, schema with long fixed keys, greedy (same tokens on and off: {j['same_tokens']}; "
              f"seconds: median of {args.rounds} alternated rounds):")
        print(f"{'':<22}{'steps':>7}{'tokens':>8}{'forced':>8}{'seconds':>9}{'tok/s':>8}")
        for b in ("alone", "batch"):
            for onoff in ("off", "on"):
                r = j[f"{onoff}/{b}"]
                label = f"{'1 request' if b == 'alone' else f'{args.jf_requests} requests'}, jf {onoff}"
                print(f"{label:<22}{r['steps']:>7}{r['tokens']:>8}{r['forced']:>8}{r['seconds']:>9.2f}"
                      f"{r['tokens'] / r['seconds']:>8.0f}")
            on, off = j[f"on/{b}"], j[f"off/{b}"]
            print(f"  saved: {1 - on['steps'] / off['steps']:.0%} of the steps, {1 - on['seconds'] / off['seconds']:.0%} "
                  f"of the time")
    del runner

    if "http" not in skip:
        levels = [int(x) for x in args.concurrency.split(",")]
        doc["http"] = {}
        for jf in (True, False):
            h = http_tokens(served, args.dtype, args.port, levels, args.rounds, jf, args.max_new, args.prompt_len,
                            args.threads)
            doc["http"]["on" if jf else "off"] = h
            print(f"\nHTTP /v1/completions streamed, jump-forward {'on' if jf else 'off'} (launch -> ready "
                  f"{h['ready_s']:.1f} s), output tok/s per round:")
            for c in levels:
                con = [x["output_throughput"] for x in h["rows"][c]["constrained"]]
                non = [x["output_throughput"] for x in h["rows"][c]["none"]]
                toks = med([x["total_output_tokens"] / max(1, x["completed"]) for x in h["rows"][c]["constrained"]])
                ratio = [a / b for a, b in zip(con, non)]
                print(f"  c={c:<3} constrained {', '.join(f'{x:.0f}' for x in con)}; none {', '.join(f'{x:.0f}' for x in non)}"
                      f"; constrained/none {', '.join(f'{x:.2f}' for x in ratio)} (median {med(ratio):.2f}); "
                      f"{toks:.0f} tokens per constrained answer")
    (out / "structured-summary.json").write_text(json.dumps(doc, indent=1, default=str))


if __name__ == "__main__":
    main()
