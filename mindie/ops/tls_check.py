"""``python -m mindie.ops.tls_check check LISTENERS_JSON``: exit 0 when every TLS file of the
launch plan loads, else 1 with the reason (the launcher runs it before forwarding SIGHUP)."""
from __future__ import annotations

import sys

from mindie.server.listeners import read_listeners
from mindie.runtime.tls import TlsError, check_plane


def main(argv: list[str] | None = None) -> int:
    """``python -m mindie.ops.tls_check check LISTENERS_JSON``: exit 0 when every TLS file of the plan
    loads, else 1 with the reason (the launcher runs it before forwarding SIGHUP)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "check":
        print("usage: python -m mindie.ops.tls_check check LISTENERS_JSON", file=sys.stderr)
        return 2
    try:
        for listener in read_listeners(args[1]):
            if listener.tls is not None:
                check_plane(listener.tls)
    except TlsError as e:
        print(f"TLS files not usable: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
