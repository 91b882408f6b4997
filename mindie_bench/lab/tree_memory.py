#!/usr/bin/env python3
"""Memory of a server's process tree: resident (VmRSS) and proportional (Pss) bytes.

A server that forks (this one: launcher, gunicorn master and front ends, supervisor, device
workers) shares pages between its processes, so the sum of their VmRSS counts those pages more
than once; the sum of their Pss (``/proc/PID/smaps_rollup``: each shared page split among the
processes that map it) is what the tree costs the machine. A single-process server (llama.cpp's
``llama-server``) has Pss = VmRSS less what it shares with other programs (its libraries).

    python -m mindie_bench.lab.tree_memory NAME=PID [NAME=PID ...] [--json FILE]

prints one line per tree (MiB) and, with ``--json``, appends the figures to FILE
(llama_server_side_by_side.sh measures both servers after each comparison).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def children() -> dict[int, list[int]]:
    """Every process's children, by parent pid (one pass over /proc)."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile
            out.setdefault(ppid, []).append(int(entry))
    return out


def tree_pids(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    kids = children()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def _field(path: str, key: str) -> int:
    """``key``'s kB figure in a /proc status-style file, in bytes (0 if the process is gone)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants (shared pages counted per process)."""
    return sum(_field(f"/proc/{p}/status", "VmRSS:") for p in tree_pids(pid))


def tree_pss(pid: int) -> int:
    """Proportional resident bytes of ``pid`` and its descendants (shared pages split)."""
    return sum(_field(f"/proc/{p}/smaps_rollup", "Pss:") for p in tree_pids(pid))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trees", nargs="+", metavar="NAME=PID", help="a label and the root pid of its tree")
    ap.add_argument("--json", metavar="FILE", help="append {label: {pss_mib, rss_mib, processes}} lines to FILE")
    args = ap.parse_args(argv)
    row: dict[str, object] = {"time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    for spec in args.trees:
        name, _, pid_s = spec.rpartition("=")
        if not name or not pid_s.isdigit():
            ap.error(f"expected NAME=PID, got {spec!r}")
        pid = int(pid_s)
        if not os.path.exists(f"/proc/{pid}"):
            print(f"{name}: pid {pid} is not running", file=sys.stderr)
            return 1
        pss, rss, n = tree_pss(pid), tree_rss(pid), len(tree_pids(pid))
        row[name] = {"pss_mib": round(pss / 2**20, 1), "rss_mib": round(rss / 2**20, 1), "processes": n}
        print(f"{name}: {pss / 2**20:.1f} MiB proportional (Pss), {rss / 2**20:.1f} MiB resident (VmRSS summed), "
              f"{n} process{'es' if n > 1 else ''}")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
