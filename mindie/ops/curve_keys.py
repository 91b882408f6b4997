"""Make the ZeroMQ CURVE key directory of tcp worker links (``BackendConfig.workerCurveKeyDir``).

    python -m mindie.ops.curve_keys DIR [--force]

Writes, with pyzmq's ``zmq.auth.create_certificates`` (the layout is mindie/runtime/curve.py):
``worker.key_secret`` / ``worker.key`` (the workers' keypair), ``frontend.key_secret`` /
``frontend.key`` (the front ends' keypair) and ``clients/frontend.key`` and ``clients/worker.key``
(the keys allowed to connect: the front ends, and the workers' own, with which a prefill worker
authenticates its KV transfers to a decode worker's tcp endpoint). DIR is created mode 0700 and secret files are written mode 0600. Existing key files
are kept unless ``--force``. Torch-free.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

from mindie.runtime.curve import (CLIENTS_DIR, FRONTEND_SECRET, WORKER_PUBLIC, WORKER_SECRET, CurveKeyError,
                                   check_key_dir)


def create_key_dir(key_dir: str, force: bool = False) -> list[str]:
    """Make the key files in ``key_dir``; returns the paths written."""
    import zmq.auth

    clients = os.path.join(key_dir, CLIENTS_DIR)
    names = (WORKER_SECRET, WORKER_PUBLIC, FRONTEND_SECRET, "frontend.key")
    existing = [n for n in names if os.path.exists(os.path.join(key_dir, n))]
    if existing and not force:
        raise FileExistsError(f"{key_dir} already holds {', '.join(existing)} (--force replaces them)")
    old = os.umask(0o077)  # secret files are never readable by others, not even for a moment
    try:
        os.makedirs(clients, 0o700, exist_ok=True)
        written = []
        for name in ("worker", "frontend"):
            public, secret = zmq.auth.create_certificates(key_dir, name)
            os.chmod(secret, 0o600)
            os.chmod(public, 0o644)
            written += [secret, public]
        for name in ("frontend.key", WORKER_PUBLIC):
            allowed = os.path.join(clients, name)
            shutil.copyfile(os.path.join(key_dir, name), allowed)
            os.chmod(allowed, 0o644)
            written.append(allowed)
    finally:
        os.umask(old)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mindie.ops.curve_keys",
                                 description="Make the CURVE key directory of tcp worker links "
                                             "(BackendConfig.workerCurveKeyDir).")
    ap.add_argument("dir", help="directory to write the key files to (created mode 0700)")
    ap.add_argument("--force", action="store_true", help="replace existing key files")
    args = ap.parse_args(argv)
    try:
        written = create_key_dir(args.dir, args.force)
        check_key_dir(args.dir)
    except (OSError, ValueError, CurveKeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
