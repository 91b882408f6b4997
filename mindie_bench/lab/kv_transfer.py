#!/usr/bin/env python3
"""KV transfer throughput (prefill/decode disaggregation): GB/s of KV blocks moved between two
caches with workers/pd_transfer.py's framing, over ipc and over tcp+CURVE on loopback.

The sender exports each block of a source cache zero-copy (``HostStaging.export``: one frame per
layer's K and V), computes its CRC-32 and sends ``[KvBlock header, frames...]`` from a DEALER; the
receiver (a ROUTER, as a decode worker's KV endpoint) checks the CRC and copies the block into a
destination cache (``HostStaging.load``), as workers/pd_transfer.py does. Figures are end to end:
first frame sent to last block written. ``--no-crc`` shows what the checksum costs.

    python -m mindie_bench.lab.kv_transfer                       # a 1B Llama shape, bf16, 128-token blocks
    python -m mindie_bench.lab.kv_transfer --layers 4 --kv-heads 2 --head-dim 64 --block 16 --dtype float32

Imports workers/pd_transfer.py (its messages, CRC and staging) and pyzmq; no server, no model.

``--ttft``: the transfer's share of TTFT on real servers. A prefill instance P and a decode instance D
(``scripts/launch.sh``, the default model unless ``--model``, one worker thread each, ``inferMode dmi``,
``interCommPort``, one CURVE key directory) and, in one run, interleaved: each prompt (fresh random ids,
no prefix hit) sent P -> D with D's ipc endpoint, P -> D with its tcp endpoint (CURVE), and to D alone
(hybrid: D computes the prompt). TTFT = both requests sent -> D's first streamed token; the bytes moved
from P's log. Prints TTFT p50 per path and size, and the tcp+CURVE path's extra TTFT over ipc.
"""
from __future__ import annotations

import argparse
import threading
import time

import msgspec
import torch
import zmq

from workers.pd_transfer import HostStaging, KvBlock, crc_of


def _caches(layers: int, blocks: int, kv_heads: int, block: int, head_dim: int, dtype: torch.dtype):
    shape = (blocks, kv_heads, block, head_dim)
    return [torch.randn(shape).to(dtype) for _ in range(layers)], [torch.randn(shape).to(dtype) for _ in range(layers)]


def run(endpoint: str, curve: bool, args, dtype: torch.dtype) -> tuple[float, float]:
    """(GB/s, seconds) moving ``args.blocks`` blocks ``args.rounds`` times."""
    src = HostStaging(*_caches(args.layers, args.blocks, args.kv_heads, args.block, args.head_dim, dtype))
    dst = HostStaging(*_caches(args.layers, args.blocks, args.kv_heads, args.block, args.head_dim, dtype))
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for s in (router, dealer):
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.SNDHWM, 0)
    if curve:
        server_pub, server_sec = zmq.curve_keypair()
        client_pub, client_sec = zmq.curve_keypair()
        router.curve_server, router.curve_secretkey, router.curve_publickey = True, server_sec, server_pub
        dealer.curve_serverkey, dealer.curve_publickey, dealer.curve_secretkey = server_pub, client_pub, client_sec
    if endpoint.startswith("tcp://"):
        port = router.bind_to_random_port("tcp://127.0.0.1")
        endpoint = f"tcp://127.0.0.1:{port}"
    else:
        router.bind(endpoint)
    dealer.connect(endpoint)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(KvBlock)
    total = args.blocks * args.rounds
    errors: list[str] = []

    def receive() -> None:
        for _ in range(total):
            frames = router.recv_multipart(copy=False)
            head = dec.decode(frames[1].bytes)
            payload = [f.buffer for f in frames[2:]]
            if not args.no_crc and crc_of(payload) != head.crc:
                errors.append(f"block {head.seq}: checksum mismatch")
            dst.load(head.seq % args.blocks, payload)

    t = threading.Thread(target=receive)
    t.start()
    time.sleep(0.2)  # the CURVE handshake before the clock starts
    t0 = time.perf_counter()
    nbytes = 0
    for i in range(total):
        views = src.export(i % args.blocks)
        crc = 0 if args.no_crc else crc_of(views)
        size = sum(v.nbytes for v in views)
        dealer.send_multipart([enc.encode(KvBlock("bench", i, [0] * args.block, crc, size)), *views], copy=False)
        nbytes += size
    t.join()
    dt = time.perf_counter() - t0
    assert not errors, errors[:3]
    assert all(torch.equal(x, y) for x, y in zip(src.k + src.v, dst.k + dst.v)), "a block arrived changed"
    router.close(0)
    dealer.close(0)
    ctx.term()
    return nbytes / dt / 1e9, dt


def _launch(tmp, name: str, port: int, server: dict, key_dir: str, model: str, threads: int):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    cfg = {"ServerConfig": {"ipAddress": "127.0.0.1", "port": port, "managementPort": port, "metricsPort": port,
                            "httpsEnabled": False, "runDir": f"/tmp/kvb-{name}-{port}", "inferMode": "dmi",
                            "kvTransferLeaseMs": 60000, "kvTransferTimeoutMs": 60000, **server},
           "BackendConfig": {"npuDeviceIds": [[0]], "deviceType": "cpu", "cpuThreadsPerWorker": threads,
                             "workerCurveKeyDir": key_dir,
                             "ModelDeployConfig": {"maxSeqLen": 4096, "maxInputTokenLen": 3072,
                                                   "ModelConfig": [{"modelName": "m", "modelWeightPath": model,
                                                                    "cpuMemSize": 2}]},
                             "ScheduleConfig": {"cacheBlockSize": 16, "maxBatchSize": 8, "maxPrefillBatchSize": 8, "maxPrefillTokens": 4096,
                                                "speculativeDecoding": False}}}
    path = Path(tmp) / f"{name}.json"
    path.write_text(json.dumps(cfg))
    log = open(Path(tmp) / f"{name}.log", "wb")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MIES_", "MINDIE_"))}
    env["PYTHON"] = sys.executable
    proc = subprocess.Popen(["bash", str(root / "scripts" / "launch.sh"), "--config", str(path), "--frontends", "1"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
    return proc, log, Path(tmp) / f"{name}.log"


def ttft(args) -> None:
    """The transfer's share of TTFT (``--ttft``, the module docstring)."""
    import concurrent.futures
    import json
    import random
    import re
    import signal
    import statistics
    import tempfile
    import uuid

    import httpx

    from mindie.ops.curve_keys import create_key_dir
    from mindie_bench.lab.fleet import _free_run

    tmp = tempfile.mkdtemp(prefix="kvttft")
    keys = f"{tmp}/keys"
    create_key_dir(keys)
    base = _free_run(4)
    servers = {"P": _launch(tmp, "p", base, {"pdRole": "prefill", "interCommPort": base + 2}, keys, args.model, 1),
               "D": _launch(tmp, "d", base + 1, {"pdRole": "decode", "interCommPort": base + 3}, keys, args.model, 1)}
    url = {"P": f"http://127.0.0.1:{base}", "D": f"http://127.0.0.1:{base + 1}"}
    try:
        deadline = time.monotonic() + 300
        for name in servers:
            while True:
                try:
                    if httpx.get(url[name] + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or servers[name][0].poll() is not None:
                    raise SystemExit(f"{name} did not start: {servers[name][2].read_text()[-2000:]}")
                time.sleep(0.5)
        pd = httpx.get(url["D"] + "/v2/status", timeout=10).json()["pd"]
        ipc = next(e for e in pd["kvEndpoints"] if e.startswith("ipc://"))
        tcp = next(e for e in pd["kvEndpoints"] if e.startswith("tcp://"))
        key = pd["kvCurvePublicKey"]
        vocab = 20000
        rng = random.Random(7)

        def first_token(body: dict, headers: dict) -> float:
            t0 = time.perf_counter()
            with httpx.stream("POST", url["D"] + "/infer_token", json=body, headers=headers, timeout=300) as r:
                dt = None
                for line in r.iter_lines():  # read to the end: the request completes before the next
                    if line.startswith("data:") and dt is None:
                        dt = time.perf_counter() - t0
                if r.status_code != 200 or dt is None:
                    raise RuntimeError(f"no token: {r.status_code}")
                return dt

        def one(path: str, n: int) -> tuple[float, int]:
            body = {"input_id": [rng.randrange(100, vocab) for _ in range(n)], "stream": True,
                    "parameters": {"max_new_tokens": 2}}
            if path == "hybrid":
                return first_token(body, {}), 0
            ep = ipc if path == "ipc" else tcp
            tid = uuid.uuid4().hex
            order = {"op": "prefill", "transferId": tid, "kvEndpoint": ep}
            if path == "tcp+CURVE":
                order["kvCurvePublicKey"] = key
            with concurrent.futures.ThreadPoolExecutor(1) as ex:
                fut = ex.submit(httpx.post, url["P"] + "/infer_token", json=body, timeout=300,
                                headers={"X-Mindie-PD": json.dumps(order)})
                dt = first_token(body, {"X-Mindie-PD": json.dumps({"op": "decode", "transferId": tid,
                                                                   "kvEndpoint": ep})})
                assert fut.result().status_code == 200, fut.result().text
            m = re.search(rf"kv transfer {tid}: (\d+) blocks, (\d+) bytes", servers["P"][2].read_text(errors="replace"))
            return dt, int(m.group(2)) if m else -1

        paths = ("ipc", "tcp+CURVE", "hybrid")
        one("ipc", 64), one("tcp+CURVE", 64), one("hybrid", 64)  # warm-up: kernels, links
        res: dict = {(p, n): [] for p in paths for n in args.sizes}
        nbytes: dict = {}
        for _ in range(args.ttft_rounds):
            for n in args.sizes:
                for p in paths:
                    dt, b = one(p, n)
                    res[(p, n)].append(dt * 1000)
                    if b > 0:
                        nbytes[n] = b
        print(f"TTFT through P -> D, model {args.model or 'default'}, {args.ttft_rounds} rounds interleaved (ms, p50)")
        print(f"{'prompt':>7s} {'KV MiB':>7s} " + " ".join(f"{p:>10s}" for p in paths) + "  tcp+CURVE - ipc")
        for n in args.sizes:
            med = {p: statistics.median(res[(p, n)]) for p in paths}
            print(f"{n:7d} {nbytes.get(n, 0) / 2**20:7.1f} " + " ".join(f"{med[p]:10.0f}" for p in paths) +
                  f"  {med['tcp+CURVE'] - med['ipc']:+.0f} ms ({(med['tcp+CURVE'] - med['ipc']) / med['tcp+CURVE'] * 100:+.1f} % of its TTFT)")
    finally:
        for proc, log, _ in servers.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except Exception:  # noqa: BLE001
                    proc.kill()
            log.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=128, help="tokens per block (cacheBlockSize)")
    ap.add_argument("--blocks", type=int, default=64, help="blocks in each cache")
    ap.add_argument("--rounds", type=int, default=4, help="times every block is sent")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-crc", action="store_true")
    ap.add_argument("--ipc-path", default="/tmp/mindie-kv-bench.ipc")
    ap.add_argument("--ttft", action="store_true", help="also the transfer's share of TTFT on real servers")
    ap.add_argument("--model", default="", help="--ttft: modelWeightPath ('' = the default model)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 1024], help="--ttft: prompt tokens")
    ap.add_argument("--ttft-rounds", type=int, default=5)
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    block_bytes = 2 * args.layers * args.kv_heads * args.block * args.head_dim * dtype.itemsize
    print(f"block: {args.layers} layers x K,V x {args.kv_heads} heads x {args.block} tokens x {args.head_dim} "
          f"({args.dtype}) = {block_bytes / 2**20:.2f} MiB; {args.blocks * args.rounds} blocks per transport; "
          f"crc32 {'off' if args.no_crc else 'on'}")
    for name, ep, curve in (("ipc", f"ipc://{args.ipc_path}", False), ("tcp", "tcp://", False),
                            ("tcp+CURVE", "tcp://", True)):
        gbs, dt = run(ep, curve, args, dtype)
        print(f"{name:10s} {gbs:6.2f} GB/s  ({dt * 1000:.0f} ms; per block {dt / (args.blocks * args.rounds) * 1e3:.2f} ms)")
    if args.ttft:
        ttft(args)


if __name__ == "__main__":
    main()
