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


if __name__ == "__main__":
    main()
