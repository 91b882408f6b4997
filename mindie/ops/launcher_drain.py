"""``python -m mindie.ops.launcher_drain RUN_DIR --drain S [--force]``: the launcher's drain on a stop signal.

scripts/launch.sh runs it when it gets SIGTERM or SIGINT, before it stops any process, so a signal
stops the server the way ``/stopService`` does (docs/operations.md, "Stop"): it gives the stop
order (mindie/server/service_state.py; kept if ``/stopService`` gave one already) so that every front end
refuses new inference with MindIE's 503 while its listeners stay open, then waits until no request
is in progress (mindie/server/admission.py) or the drain bound has passed and the front ends have cut what
still ran (they do it themselves at the order's deadline: mindie/server/drain.py). ``--force`` (a second
signal, or a Force order already given) makes the deadline now.

Exit status: 0 drained (nothing in progress), 1 requests still in progress after the bound,
3 the order is a Force one (the launcher then stops every process at once).
"""
from __future__ import annotations

import argparse
import sys
import time

from mindie.server.admission import in_progress
from mindie.server.service_state import FORCE, GRACEFUL, ServiceState

CUT_GRACE_S = 3.0  # after the deadline: for the front ends to cut and send the final frames
POLL_S = 0.1
PROGRESS_EVERY_S = 5.0


def say(text: str) -> None:
    print(f"launch.sh: {text}", file=sys.stderr, flush=True)


def drain(run_dir: str, drain_s: float, force: bool = False, wait: bool = True) -> int:
    state = ServiceState(run_dir)
    given = state.stop(FORCE if force else GRACEFUL, drain_s)
    order = state.force() if force and not given else state.order()
    if order is None:  # removed under us (a stop that already finished)
        return 0
    n = in_progress(run_dir)
    if given or force:
        if order.mode == FORCE:
            say(f"forced stop: new requests get 503; {n} request(s) in progress are cut now")
        else:
            say(f"stopping: new requests get 503; {n} request(s) in progress have up to {drain_s:g} s to finish "
                "(ServerConfig.drainTimeoutS)")
    elif order.mode == FORCE:
        say(f"forced stop (/stopService?mode=Force): {n} request(s) in progress")
    else:
        say(f"stopping: the drain /stopService began goes on ({n} request(s) in progress, "
            f"cut in {max(0.0, order.deadline - time.time()):.0f} s)")
    if not wait:
        return 3 if order.mode == FORCE else 0
    t0 = time.monotonic()
    end = time.monotonic() + max(0.0, order.deadline - time.time()) + CUT_GRACE_S
    next_note = t0 + PROGRESS_EVERY_S
    while (n := in_progress(run_dir)) and time.monotonic() < end:
        if time.monotonic() >= next_note:
            say(f"draining: {n} request(s) in progress, cut in {max(0.0, order.deadline - time.time()):.0f} s")
            next_note += PROGRESS_EVERY_S
        time.sleep(POLL_S)
        if (o := state.order()) is not None and o != order:  # escalated meanwhile (a second signal)
            order = o
            end = time.monotonic() + max(0.0, order.deadline - time.time()) + CUT_GRACE_S
    if n:
        say(f"{n} request(s) still in progress after the drain: stopping anyway")
        return 1
    if order.mode != FORCE:
        say(f"drained in {time.monotonic() - t0:.1f} s")
    return 3 if order.mode == FORCE else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Drain the server using RUN_DIR before its processes stop "
                                             "(run by scripts/launch.sh on SIGTERM/SIGINT).")
    ap.add_argument("run_dir")
    ap.add_argument("--drain", type=float, required=True, help="seconds the requests in progress get "
                    "(ServerConfig.drainTimeoutS)")
    ap.add_argument("--force", action="store_true", help="cut the requests in progress now")
    ap.add_argument("--no-wait", action="store_true", help="give (or escalate) the order and return")
    args = ap.parse_args(argv)
    return drain(args.run_dir, args.drain, args.force, wait=not args.no_wait)


if __name__ == "__main__":
    raise SystemExit(main())
