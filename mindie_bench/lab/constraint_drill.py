"""Hostile structured-output constraints against one real server (docs/reliability.md, "Hostile
constraints"): each is sent through the OpenAI (``/v1/completions``) and vLLM (``/generate``)
families; prints status, seconds and the message's start, and the device worker's RSS before and
after (a constraint the front end refuses never reaches the worker).

    PYTHONPATH=. python -m mindie_bench.lab.constraint_drill [MODEL_DIR]   # default: the default model

Starts ``scripts/launch.sh`` through tests/harness.py (as chaos.py does); loopback only.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx

MANY = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10000)}}
RECURSIVE = [
    {"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}},
     "$ref": "#/$defs/a"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"$ref": "#"},
]
BODIES = [("10,000 properties", {"guided_json": MANY}),
          *[(f"recursive $ref {i}", {"guided_json": r}) for i, r in enumerate(RECURSIVE)],
          ("(a{1000}){1000}", {"guided_regex": "(a{1000}){1000}"})]


def main(argv: list[str] | None = None) -> int:
    from tests.harness import demo_server, process_roles, rss_mib

    p = argparse.ArgumentParser(prog="mindie-bench constraint-drill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default="", help="model directory or .gguf file (default: the default model)")
    model = p.parse_args(argv).model
    with demo_server(Path(tempfile.mkdtemp()), model) as s:
        workers = [p for p, r in process_roles(s.launcher_pid()).items() if r == "worker"]
        print(f"worker RSS before: {rss_mib(workers):.0f} MiB")
        name = httpx.get(s.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        for label, extra in BODIES:
            for route, body in (("/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 5, **extra}),
                                ("/generate", {"prompt": "hi", "max_tokens": 5, **extra})):
                t = time.monotonic()
                r = httpx.post(s.url + route, json=body, timeout=300)
                print(f"{label:20s} {route:16s} {r.status_code} {time.monotonic() - t:6.2f} s  {r.text[:160]}")
        print(f"worker RSS after: {rss_mib(workers):.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
