"""Instance discovery for a coordinator on Kubernetes (deploy/k8s/motor/): the server pods of a
StatefulSet, found by their stable DNS names behind its headless Service.

    python -m coordinator.fleet.discover render --template ms_coordinator.json --out FILE [options]
    python -m coordinator.fleet.discover watch  --manage http://127.0.0.1:1026 [options]

A StatefulSet ``S`` with headless Service ``H`` in namespace ``N`` names its pods ``S-0``,
``S-1``, ... and publishes ``S-<k>.H.N.svc.<cluster domain>`` for each (with
``publishNotReadyAddresses: true`` as soon as the pod has an address, ready or not). Ordinals
0 .. ``--max-replicas``-1 are looked up; those that resolve are the instances, id = ordinal.

- ``render`` (an init container): waits (bounded, ``--wait``) until at least ``--min-instances``
  names resolve, then writes the template with ``instances`` =
  ``[{"id": k, "ip": "S-k.H.N.svc.<domain>", "business_port": P, "mgmt_port": M}, ...]`` (the
  DNS name, which the coordinator resolves at each connection, so a pod that moves to a new
  address is followed; ``--address ip``: the address it resolves to now) and checks the result
  with the coordinator's own loader.
- ``watch`` (a sidecar, an init container with ``restartPolicy: Always``): every ``--interval``
  seconds looks the names up again and, when the set changed (a scale up or down; with
  ``--address ip`` also a pod rescheduled to a new address; a pod is dropped after ``--drop-after``
  lookups in a row miss it), sends MindIE's ``POST
  /v1/instances/refresh`` (``ids`` = every instance; ``instances`` with ``id``, ``ip``,
  ``port``, ``mgmt_port``, ``metric_port``) to the coordinator's manage port.

Prefill/decode fleets (``deploy_mode: pd_separate``, deploy/k8s/motor-pd/): ``--group
STATEFULSET:SERVICE:ROLE:FIRST_ID`` (repeated) looks up each StatefulSet's pods with ids
FIRST_ID + ordinal and gives their records ``role`` (and, in a refresh, MindIE's
``static_info`` ``label`` 2=P 3=D / ``role`` 80/68), instead of ``--statefulset``/``--service``.

The business and management ports are the server config's (``--business-port``,
``--mgmt-port``, default MindIE's 1025 and 1026; ``--metric-port`` default: the management port).

A manage port protected by a bearer token (coordinator/manage_auth.py): the sidecar reads the
same ``MINDIE_MS_COORDINATOR_MANAGE_TOKEN_FILE`` (or ``MINDIE_MS_COORDINATOR_MANAGE_TOKEN``) as
the coordinator and sends ``Authorization: Bearer <token>`` with every refresh; a token it cannot
use stops it at once with the reason (exit 2), not with a 401 every ``--interval``.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from typing import Callable, Optional

Resolver = Callable[[str], Optional[str]]


def resolve(name: str) -> Optional[str]:
    """The first address of ``name``, or None when it does not resolve (yet)."""
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return None
    return infos[0][4][0] if infos else None


def namespace(env=os.environ) -> str:
    """$POD_NAMESPACE (the downward API), else the service account's namespace file, else default."""
    ns = env.get("POD_NAMESPACE", "").strip()
    if ns:
        return ns
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def pod_name(args: argparse.Namespace, k: int, group: Optional[tuple] = None) -> str:
    sts, svc = (group[0], group[1]) if group else (args.statefulset, args.service)
    return f"{sts}-{k}.{svc}.{args.namespace}.svc.{args.cluster_domain}"


# MindIE MS static_info codes for a role (coordinator/pd_pairing.py reads them back)
STATIC_ROLE = {"prefill": {"label": 2, "role": 80}, "decode": {"label": 3, "role": 68}, "flex": {}}


def parse_group(text: str) -> tuple[str, str, str, int]:
    """``STATEFULSET:SERVICE:ROLE:FIRST_ID`` -> a tuple (argparse type)."""
    parts = text.split(":")
    if len(parts) != 4 or parts[2] not in STATIC_ROLE or not parts[3].isdigit() or not all(parts[:2]):
        raise argparse.ArgumentTypeError(f"{text!r}: expected STATEFULSET:SERVICE:ROLE:FIRST_ID with ROLE "
                                         "prefill, decode or flex")
    return parts[0], parts[1], parts[2], int(parts[3])


def discover(args: argparse.Namespace, resolver: Resolver = resolve) -> list[dict]:
    """Instance records (Motor's endpoint shape) of the pods whose names resolve now."""
    out = []
    for group in getattr(args, "group", None) or [None]:
        for k in range(args.max_replicas):
            name = pod_name(args, k, group)
            ip = resolver(name)
            if ip:
                rec = {"id": k + (group[3] if group else 0), "ip": name if args.address == "name" else ip,
                       "business_port": args.business_port, "mgmt_port": args.mgmt_port}
                if group:
                    rec["role"] = group[2]
                out.append(rec)
    return out


def refresh_body(instances: list[dict], metric_port: int) -> dict:
    """MindIE's /v1/instances/refresh body: ``ids`` is the whole set (an id left out is removed)."""
    return {"ids": [i["id"] for i in instances],
            "instances": [{"id": i["id"], "ip": i["ip"], "port": str(i["business_port"]),
                           "mgmt_port": str(i["mgmt_port"]), "metric_port": str(metric_port),
                           "model_name": "", "static_info": dict(STATIC_ROLE.get(i.get("role", ""), {})),
                           "dynamic_info": {}} for i in instances]}


def render(args: argparse.Namespace, resolver: Resolver = resolve) -> int:
    try:
        with open(args.template, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        print(f"discover: cannot read the template {args.template}: {e}", file=sys.stderr)
        return 2
    if not isinstance(doc, dict):
        print(f"discover: {args.template}: the top level must be a JSON object", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.wait
    while True:
        found = discover(args, resolver)
        if len(found) >= args.min_instances or time.monotonic() >= deadline:
            break
        time.sleep(min(args.interval, max(0.0, deadline - time.monotonic())))
    if len(found) < args.min_instances:
        print(f"discover: {len(found)} of at least {args.min_instances} instance(s) resolve after {args.wait:g} s "
              f"(looked up {pod_name(args, 0)} .. ordinal {args.max_replicas - 1})", file=sys.stderr)
        return 1
    doc["instances"] = found
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
    from mindie.config import ConfigError
    from coordinator.config import load
    try:
        load(tmp, env={})
    except ConfigError as e:
        print(f"discover: the rendered config is refused: {e}", file=sys.stderr)
        return 2
    os.replace(tmp, args.out)
    print(f"discover: {args.out}: {len(found)} instance(s): "
          + ", ".join(f"{i['id']} {i['ip']}" for i in found), flush=True)
    return 0


def tls_context(cacert: str = "", cert: str = "", key: str = ""):
    """HTTPS to the manage port: its CA (default: the system's), our certificate for mutual TLS."""
    import ssl
    ctx = ssl.create_default_context(cafile=cacert or None)
    if cert:
        ctx.load_cert_chain(cert, key or None)
    return ctx


def auth_headers(env=os.environ) -> dict:
    """``Authorization: Bearer <token>`` when the manage port's token is set in ``env`` (the
    coordinator's own variables), else nothing. Raises ManageAuthError for a token it cannot use."""
    from coordinator.manage_auth import load_token
    token = load_token(env)
    return {"Authorization": "Bearer " + token.decode("ascii")} if token is not None else {}


def post_refresh(manage: str, body: dict, timeout: float, context=None,
                 headers: Optional[dict] = None) -> tuple[int, str]:
    req = urllib.request.Request(manage.rstrip("/") + "/v1/instances/refresh", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as r:
            return r.status, r.read(4096).decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read(4096).decode("utf-8", "replace")
    except (OSError, urllib.error.URLError) as e:
        return 0, str(getattr(e, "reason", e))


def watch(args: argparse.Namespace, resolver: Resolver = resolve, rounds: Optional[int] = None) -> int:
    """Refresh the coordinator whenever the resolved set changes (also after a failed refresh and
    after the coordinator restarts: every ``--resync`` seconds the set is sent again). A pod that
    stops resolving is dropped only after ``--drop-after`` lookups in a row miss it: one failed
    lookup (a DNS hiccup) does not take an instance out of the coordinator."""
    from coordinator.manage_auth import ManageAuthError
    ctx = tls_context(args.cacert, args.cert, args.key) if args.manage.startswith("https:") else None
    try:
        auth = auth_headers()
    except ManageAuthError as e:
        print(f"discover: the manage port's token cannot be used: {e}", file=sys.stderr, flush=True)
        return 2
    sent: Optional[list[dict]] = None
    kept: dict[int, dict] = {}  # id -> the record last sent
    misses: dict[int, int] = {}
    last = 0.0
    n = 0
    while rounds is None or n < rounds:
        n += 1
        now = {i["id"]: i for i in discover(args, resolver)}
        for iid, rec in kept.items():
            if iid in now:
                misses.pop(iid, None)
                continue
            misses[iid] = misses.get(iid, 0) + 1
            if misses[iid] < args.drop_after:
                now[iid] = rec
        found = [now[k] for k in sorted(now)]
        if found != sent or time.monotonic() - last >= args.resync:
            status, text = post_refresh(args.manage, refresh_body(found, args.metric_port or args.mgmt_port), 5.0,
                                        ctx, auth)
            if status == 200:
                if found != sent:
                    print(f"discover: refreshed {len(found)} instance(s): "
                          + ", ".join(f"{i['id']} {i['ip']}" for i in found), flush=True)
                sent, last = found, time.monotonic()
                kept = {i["id"]: i for i in found}
                misses = {k: v for k, v in misses.items() if k in kept}
            else:
                print(f"discover: refresh to {args.manage} answered {status or 'nothing'}: {text[:200]}",
                      file=sys.stderr, flush=True)
        if rounds is None or n < rounds:
            time.sleep(args.interval)
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m coordinator.fleet.discover",
                                description="Find the server pods of a StatefulSet by DNS for a coordinator: "
                                            "render its ms_coordinator.json (init container) or keep it current "
                                            "with /v1/instances/refresh (sidecar).")
    p.add_argument("command", choices=("render", "watch"))
    p.add_argument("--statefulset", default="mindie-server", help="the server StatefulSet (default mindie-server)")
    p.add_argument("--service", default="mindie-server", help="its headless Service (default mindie-server)")
    p.add_argument("--group", action="append", type=parse_group, default=None, metavar="STS:SVC:ROLE:FIRST_ID",
                   help="pd_separate: a StatefulSet of one role, its headless Service and the id of its "
                        "pod 0 (repeat per role; replaces --statefulset/--service)")
    p.add_argument("--namespace", default=None, help="default $POD_NAMESPACE, else the pod's service account's")
    p.add_argument("--cluster-domain", default="cluster.local")
    p.add_argument("--max-replicas", type=int, default=16, help="ordinals looked up: 0 .. N-1 (default 16)")
    p.add_argument("--business-port", type=int, default=1025, help="the servers' ServerConfig.port")
    p.add_argument("--mgmt-port", type=int, default=1026, help="the servers' ServerConfig.managementPort")
    p.add_argument("--metric-port", type=int, default=0, help="the servers' metricsPort (default: --mgmt-port)")
    p.add_argument("--address", choices=("name", "ip"), default="name",
                   help="what the instance records carry: the pod's DNS name (default: the coordinator "
                        "resolves it at connect time, so a pod rescheduled to a new address is followed "
                        "at once) or the address it resolves to now")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between lookups (default 5)")
    p.add_argument("--template", help="render: ms_coordinator.json without instances")
    p.add_argument("--out", help="render: where the config with instances goes")
    p.add_argument("--min-instances", type=int, default=1, help="render: wait for this many (default 1)")
    p.add_argument("--wait", type=float, default=600.0, help="render: at most this long (default 600 s)")
    p.add_argument("--manage", default="http://127.0.0.1:1026", help="watch: the coordinator's manage URL")
    p.add_argument("--cacert", default="", help="watch, https --manage: the CA of the manage port's certificate")
    p.add_argument("--cert", default="", help="watch, mutual TLS: our client certificate")
    p.add_argument("--key", default="", help="watch, mutual TLS: its key")
    p.add_argument("--drop-after", type=int, default=3,
                   help="watch: lookups in a row that must miss a pod before it is dropped (default 3)")
    p.add_argument("--resync", type=float, default=60.0,
                   help="watch: send the set again after this long even if unchanged (a restarted coordinator)")
    args = p.parse_args(argv)
    args.namespace = args.namespace or namespace()
    if args.command == "render" and not (args.template and args.out):
        p.error("render needs --template and --out")
    if not 1 <= args.max_replicas <= 10000:
        p.error("--max-replicas must be in [1, 10000]")
    if not args.interval > 0:
        p.error("--interval must be > 0")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return render(args) if args.command == "render" else watch(args)


if __name__ == "__main__":
    sys.exit(main())
