"""``python -m mindie.ops.run_dir hold|release RUN_DIR FD | stop RUN_DIR``: the launch script's
hold and release of the run directory (mindie/runtime/lifecycle.py), and a stop request to the
server that owns a run directory."""
from __future__ import annotations

import sys

from mindie.runtime.lifecycle import RunDirBusy, hold, release, request_stop


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m mindie.ops.run_dir hold|release RUN_DIR FD | stop RUN_DIR"
    if len(args) < 2 or args[0] not in ("hold", "release", "stop"):
        print(usage, file=sys.stderr)
        return 2
    cmd, run_dir = args[0], args[1]
    try:
        if cmd == "hold":
            hold(run_dir, int(args[2]))
        elif cmd == "release":
            removed, left = release(run_dir, int(args[2]) if len(args) > 2 else None)
            if left:
                print(f"run dir {run_dir}: left in place (locked by a live process): {', '.join(left)}",
                      file=sys.stderr)
                return 1
        else:
            print(f"sent SIGTERM to the launcher (pid {request_stop(run_dir)})", file=sys.stderr)
    except (RunDirBusy, ProcessLookupError) as e:
        print(f"run dir: {e}", file=sys.stderr)
        return 1
    except (IndexError, ValueError):
        print(usage, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
