"""``mindie-bench``: benchmark a serving deployment (``run``) or two side by side (``compare``); the
lab's benchmarks, profilers and drills (``mindie-bench engine``, ``roofline``, ... : mindie_bench/lab/)."""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from mindie_bench import lab
from mindie_bench.api_clients import APIS, Adapter, HttpClient, make_adapter, resolve_model
from mindie_bench.compare import Endpoint, compare_table, run_compare
from mindie_bench.runner import (LoadConfig, plot_cdfs, plot_sweep, result_path, run_async, run_document,
                                 run_sweep, server_info, sweep_table, write_json)
from mindie_bench.stats import format_report
from mindie_bench.workload import CHAT_MAX_TOKENS, load_tokenizer, make_workload, parse_range

DESCRIPTION = """\
Load generator for LLM serving endpoints, with the metrics of `vllm bench serve`:
TTFT, TPOT = (E2E - TTFT) / (output_tokens - 1), ITL (every gap between token frames),
E2E latency (mean, p50, p90, p99 by linear interpolation), request throughput, output
and total tokens/s, and errors. Each run writes one JSON file (command line, server
info from GET /v1/models, machine info, per-request records) and optional PNG plots.
"""

EPILOG = """\
examples:
  # our server, native API, a concurrency sweep with plots
  mindie-bench run --url http://127.0.0.1:1025 --api native --prompt-len 128 --output-len 128 \\
      --concurrency 1,8,32,64 --plot
  # vLLM (OpenAI API), Poisson arrivals at 4 req/s, at most 32 in flight, for 60 s
  mindie-bench run --url http://127.0.0.1:8100 --api openai --request-rate 4 --concurrency 32 --duration 60
  # A/B: ours (A) against vLLM (B), 3 alternating rounds per level; ratio = A/B
  mindie-bench compare --url-a http://127.0.0.1:1025 --api-a native --label-a mindie-py \\
      --url-b http://127.0.0.1:8100 --api-b openai --label-b vllm --concurrency 1,8,32 --rounds 3
  # real traffic: English chat questions, greedy, answers of their own length (<= 256 tokens),
  # streamed through /v1/chat/completions on both (here against llama.cpp's llama-server)
  mindie-bench compare --workload chat --url-a http://127.0.0.1:1025 --label-a mindie-py \\
      --url-b http://127.0.0.1:8200 --label-b llama.cpp --concurrency 1,8 --rounds 3
"""


def _levels(text: Optional[str]) -> list[Optional[int]]:
    if text is None:
        return [None]
    out: list[Optional[int]] = []
    for part in text.split(","):
        part = part.strip()
        if part:
            v = int(part)
            if v < 1:
                raise argparse.ArgumentTypeError("concurrency must be >= 1")
            out.append(v)
    if not out:
        raise argparse.ArgumentTypeError("empty concurrency list")
    return out


def _json_obj(text: str) -> dict[str, Any]:
    try:
        v = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return v


def _range(text: str) -> str:
    try:
        parse_range(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _common(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=("random", "chat"), default="random",
                   help="random (default): prompts of random token ids (--prompt-len, or --jsonl), each answer "
                        "exactly --output-len tokens long; chat: real traffic, 96 English chat questions "
                        "(mindie_bench/chat_questions.py) in a --seed order, each one user message to "
                        "POST /v1/chat/completions (--api chat, its default and only API), greedy, streamed "
                        "with usage, each answer as long as the model makes it up to --output-len (default 256; "
                        "no ignore_eos or min_tokens); warm-up uses 16 questions that are never measured")
    w.add_argument("--prompt-len", type=_range, default="128", metavar="N|LO:HI",
                   help="prompt tokens per request: a fixed N, or uniform in [LO, HI] per request (default 128)")
    w.add_argument("--output-len", type=_range, metavar="N|LO:HI",
                   help="tokens to generate per request, fixed or LO:HI (default 128); requests ask for an exact "
                        "length (ignore_eos, and min_tokens on OpenAI). With --workload chat: the max_tokens cap "
                        "of every answer (default 256)")
    w.add_argument("--jsonl", metavar="FILE",
                   help="take requests from a JSONL file instead, one per line: {\"prompt_len\", \"output_len\"} "
                        "(random ids), {\"prompt_ids\": [...], \"output_len\"} or {\"prompt\": \"text\", "
                        "\"output_len\"}; cycled to --num-prompts")
    w.add_argument("--num-prompts", type=int, metavar="N",
                   help="measured requests per segment (default: max(32, 4 x concurrency); 100 with an uncapped "
                        "--request-rate); with --duration, the pool of distinct requests that is cycled")
    w.add_argument("--vocab-size", type=int, default=32000, metavar="V",
                   help="random prompt ids are uniform in [3, V): ids 0-2 (unk/bos/eos) are avoided; keep V at "
                        "most the model's vocabulary size (default 32000)")
    w.add_argument("--tokenizer", metavar="PATH",
                   help="model directory or tokenizer.json; used by --api tgi and chat to decode random ids into "
                        "text and to count JSONL text prompts. Without it, their prompts are one common English word per id "
                        "(about one token each)")
    w.add_argument("--seed", type=int, default=0,
                   help="seed for prompt ids, lengths and Poisson arrivals (default 0); warm-up prompts use "
                        "a derived seed so they do not prime a prefix cache")

    ld = p.add_argument_group("load")
    ld.add_argument("--concurrency", metavar="C[,C...]",
                    help="requests in flight; a comma list (e.g. 1,8,32,64) runs a sweep, one segment per level. "
                         "With --request-rate it caps the in-flight count (default: 1, or no cap with a rate)")
    ld.add_argument("--request-rate", type=float, default=math.inf, metavar="R",
                    help="send requests as a Poisson process of R requests/s (seeded) instead of keeping "
                         "--concurrency busy (default: inf = closed loop at fixed concurrency)")
    ld.add_argument("--duration", type=float, metavar="S",
                    help="measure for S seconds (no new request after that, in-flight ones finish) instead of "
                         "a fixed request count")
    ld.add_argument("--warmup", type=int, metavar="N",
                    help="warm-up requests before each segment, at the same concurrency, not counted "
                         "(default: one per concurrency slot; 0 disables)")
    ld.add_argument("--timeout", type=float, default=600.0, metavar="S",
                    help="per-request limit in seconds for the whole stream; an expired request counts as an "
                         "error (default 600)")
    ld.add_argument("--no-ignore-eos", action="store_true",
                    help="do not send ignore_eos/min_tokens (outputs may end early at EOS; such requests are "
                         "counted in 'other output length'); --workload chat never sends them")
    ld.add_argument("--insecure", action="store_true", help="with https URLs, do not verify the certificate")
    ld.add_argument("--no-uvloop", action="store_true", help="use asyncio's default event loop even if uvloop is "
                                                             "installed")

    o = p.add_argument_group("output")
    o.add_argument("--out", default="bench-results", metavar="DIR",
                   help="directory for the result JSON (one file per invocation) and plots (default bench-results)")
    o.add_argument("--plot", action="store_true",
                   help="also write PNGs next to the JSON: latency CDFs (TTFT, TPOT, ITL, E2E) and, for a sweep, "
                        "output tok/s and p99 TTFT against concurrency (needs matplotlib)")
    o.add_argument("--save-itl", action="store_true",
                   help="store every token frame's arrival time per request in the JSON (large)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    o.add_argument("--quiet", action="store_true", help="print only the summary table")


def _endpoint_args(p: argparse.ArgumentParser, suffix: str, who: str, url: str, api: str) -> None:
    g = p.add_argument_group(f"endpoint{(' ' + suffix.strip('-').upper()) if suffix else ''}")
    g.add_argument(f"--url{suffix}", default=url,
                   help=f"base URL of {who} (default {url}); the API's path is appended")
    g.add_argument(f"--api{suffix}", choices=APIS,
                   help=f"API of {who} (default {api}; chat with --workload chat): native = POST /infer_token "
                        "with input_id, openai = POST /v1/completions with a token-id prompt, chat = POST "
                        "/v1/chat/completions with the prompt as text in one user message (this server, vLLM, "
                        "llama.cpp's llama-server), tgi = POST /generate_stream with text (see --tokenizer)")
    g.add_argument(f"--model{suffix}", metavar="NAME",
                   help=f"model name sent to {who} (openai, chat; default: the first id from GET /v1/models)")
    g.add_argument(f"--endpoint{suffix}", metavar="PATH", help="override the API's path (e.g. /infer)")
    g.add_argument(f"--extra-params{suffix}", type=_json_obj, default={}, metavar="JSON",
                   help="extra fields merged into the request's parameters (native, tgi) or body (openai, chat), "
                        "e.g. '{\"temperature\": 0.7, \"do_sample\": true}'")
    if suffix:
        g.add_argument(f"--label{suffix}", default=f"{suffix.strip('-').upper()}",
                       help=f"name of {who} in tables and files")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mindie-bench", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    r = sub.add_parser("run", help="benchmark one endpoint (optionally a concurrency sweep)",
                       description="Benchmark one endpoint; one segment per --concurrency level.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _endpoint_args(r, "", "the server", "http://127.0.0.1:1025", "native")
    _common(r)
    c = sub.add_parser("compare", help="two endpoints measured alternately (A B A B ...) with per-round ratios",
                       description="Measure endpoint A then B, --rounds times per concurrency level, on the same "
                                   "seeded workload; print and save the per-round ratio of output tok/s and "
                                   "its median.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _endpoint_args(c, "-a", "endpoint A", "http://127.0.0.1:1025", "native")
    _endpoint_args(c, "-b", "endpoint B", "http://127.0.0.1:8100", "openai")
    g = c.add_argument_group("comparison")
    g.add_argument("--rounds", type=int, default=3, help="A/B rounds per concurrency level (default 3)")
    g.add_argument("--ratio", choices=("a/b", "b/a"), default="a/b",
                   help="direction of every ratio: a/b = A's value divided by B's (default)")
    _common(c)
    for name, (target, text) in lab.COMMANDS.items():  # listed here; main() hands them their arguments
        sub.add_parser(name, help=f"lab: {text}", add_help=False)
    return p


def _load_config(args: argparse.Namespace, levels: Sequence[Optional[int]]) -> LoadConfig:
    return LoadConfig(concurrency=levels[0], request_rate=args.request_rate, num_prompts=args.num_prompts,
                      duration=args.duration, warmup=args.warmup, seed=args.seed, timeout=args.timeout,
                      progress=not args.no_progress, save_itl=args.save_itl, insecure=args.insecure)


def _make(args: argparse.Namespace, sfx: str, tokenizer: Any, default_api: str) -> Adapter:
    g = lambda name: getattr(args, name + sfx.replace("-", "_"))  # noqa: E731
    chat = args.workload == "chat"
    api = g("api") or ("chat" if chat else default_api)
    if chat and api != "chat":
        raise SystemExit(f"mindie-bench: --workload chat streams through /v1/chat/completions: --api{sfx} chat "
                         f"(its default), not {api}")
    # The chat workload's answers end where the model ends them: never ignore_eos/min_tokens.
    return make_adapter(api, g("url"), model=g("model"), ignore_eos=not (args.no_ignore_eos or chat),
                        extra=g("extra_params"), path=g("endpoint"), tokenizer=tokenizer)


def _workload(args: argparse.Namespace, tok: Any) -> Any:
    chat = args.workload == "chat"
    if chat and args.jsonl:
        raise SystemExit("mindie-bench: --workload chat has its own questions; it takes no --jsonl")
    out = args.output_len or (str(CHAT_MAX_TOKENS) if chat else "128")
    try:
        return make_workload(prompt_len=args.prompt_len, output_len=out, jsonl=args.jsonl,
                             vocab_size=args.vocab_size, tokenizer=tok, kind=args.workload)
    except ValueError as e:
        raise SystemExit(f"mindie-bench: {e}") from None


async def _ensure_model(ad: Adapter, insecure: bool) -> None:
    if ad.api in ("openai", "chat") and not ad.model:
        client = HttpClient(insecure=insecure)
        try:
            ad.model = await resolve_model(client, ad.base)
        finally:
            await client.aclose()
        if not ad.model:
            raise SystemExit(f"mindie-bench: no --model given and GET {ad.base}/v1/models returned none")


def _check(args: argparse.Namespace) -> list[Optional[int]]:
    levels = _levels(args.concurrency)
    if levels == [None] and math.isinf(args.request_rate):
        levels = [1]
    if args.request_rate <= 0:
        raise SystemExit("mindie-bench: --request-rate must be > 0")
    return levels


def cmd_run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    levels = _check(args)
    tok = load_tokenizer(args.tokenizer)
    workload = _workload(args, tok)
    adapter = _make(args, "", tok, "native")
    cfg = _load_config(args, levels)

    async def go() -> tuple[dict[str, Any], list[Any]]:
        await _ensure_model(adapter, args.insecure)
        info = await server_info(adapter, args.insecure)
        return info, await run_sweep(adapter, workload, levels, cfg)

    info, segs = run_async(go(), use_uvloop=not args.no_uvloop)
    doc = run_document(argv, "run", {k: v for k, v in vars(args).items() if k != "func"})
    doc.update(endpoint=adapter.describe(), server=info, levels=levels,
               points=[s.to_json(args.save_itl) for s in segs])
    path = write_json(result_path(args.out, "run", adapter.api), doc)
    if not args.quiet:
        for s in segs:
            print(format_report(s.stats, s.label))
    print(sweep_table([(s.label, s.stats) for s in segs]))
    print(f"results: {path}")
    if args.plot:
        stem = path.with_suffix("")
        if plot_cdfs([(s.label, s.results) for s in segs], Path(f"{stem}-cdf.png"), f"{adapter.api} {adapter.url}"):
            print(f"plot: {stem}-cdf.png")
        if len(segs) > 1 and all(s.concurrency for s in segs):
            if plot_sweep([(adapter.api, [(s.concurrency, s.stats) for s in segs])], Path(f"{stem}-sweep.png"),
                          f"{adapter.api} {adapter.url}"):
                print(f"plot: {stem}-sweep.png")
    return 1 if any(s.stats["completed"] == 0 for s in segs) else 0


def cmd_compare(args: argparse.Namespace, argv: Sequence[str]) -> int:
    levels = _check(args)
    if args.rounds < 1:
        raise SystemExit("mindie-bench: --rounds must be >= 1")
    tok = load_tokenizer(args.tokenizer)
    workload = _workload(args, tok)
    a = Endpoint(args.label_a, _make(args, "-a", tok, "native"))
    b = Endpoint(args.label_b, _make(args, "-b", tok, "openai"))
    cfg = _load_config(args, levels)

    async def go() -> tuple[dict[str, Any], dict[str, Any], Any]:
        await _ensure_model(a.adapter, args.insecure)
        await _ensure_model(b.adapter, args.insecure)
        info = {"A": await server_info(a.adapter, args.insecure), "B": await server_info(b.adapter, args.insecure)}
        section, segs = await run_compare(a, b, workload, levels, args.rounds, cfg, args.ratio)
        return info, section, segs

    info, section, segs = run_async(go(), use_uvloop=not args.no_uvloop)
    doc = run_document(argv, "compare", {k: v for k, v in vars(args).items() if k != "func"})
    doc.update(server=info, compare=section)
    path = write_json(result_path(args.out, "compare", f"{a.adapter.api}-vs-{b.adapter.api}"), doc)
    print(compare_table(section))
    print(f"results: {path}")
    if args.plot:
        stem = path.with_suffix("")
        series = []
        for (c, side), ss in segs.items():
            label = f"{_name(side, a if side == 'A' else b)} c={c}"
            series.append((label, [r for s in ss for r in s.results]))
        if plot_cdfs(series, Path(f"{stem}-cdf.png"), "all rounds pooled"):
            print(f"plot: {stem}-cdf.png")
        if len(levels) > 1 and all(levels):
            med = []
            for side, ep in (("A", a), ("B", b)):
                pts = []
                for lv in section["levels"]:
                    m = lv["median"][side]
                    pts.append((lv["concurrency"], {"output_throughput": m["output_throughput"],
                                                    "ttft_ms": {"p99": _median_p99(lv, side)}}))
                med.append((f"{_name(side, ep)} (median of rounds)", pts))
            if plot_sweep(med, Path(f"{stem}-sweep.png"), section["ratio_meaning"]):
                print(f"plot: {stem}-sweep.png")
    failed_all = any(r[s]["stats"]["completed"] == 0 for lv in section["levels"] for r in lv["rounds"] for s in "AB")
    return 1 if failed_all else 0


def _name(side: str, ep: Endpoint) -> str:
    return side if ep.label == side else f"{side}: {ep.label}"


def _median_p99(level: dict[str, Any], side: str) -> float:
    xs = [r[side]["stats"]["ttft_ms"]["p99"] for r in level["rounds"]]
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else float("nan")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in lab.COMMANDS:
        return lab.run(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    full = ["mindie-bench", *argv]
    try:
        return cmd_run(args, full) if args.cmd == "run" else cmd_compare(args, full)
    except KeyboardInterrupt:
        print("mindie-bench: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
