"""Run one tensor-parallel instance (or a single worker) on a batch of requests, for the tests.

    python tests/tp_instance.py MODEL_DIR WORLD OUT.json [--requests JSON [--more JSON]]

Starts WORLD processes as the supervisor would: rank 0 builds the real engine (workers.engine.assembly's
build: rendezvous, sharded load, KV blocks broadcast) and the others run
workers.tp_rank.follow. Rank 0 submits the requests, steps the engine until all finish and writes
{request_id: [token ids]} (and their log-probabilities, where a request asks them) plus the
per-rank parameter bytes to OUT.json. WORLD 1 runs the same engine without tensor parallelism, as
the reference. ``TP_TEST_INVARIANT=1``: batch-invariant mode (ScheduleConfig.batchInvariant);
``TP_TEST_ALONE=1``: after the requests all at once, each again alone (run to its end before the
next is submitted), its results under ``id + "/alone"``. ``--more`` (WORLD 1 only): a JSON list
of further [MODEL_DIR, OUT.json] pairs, each run on the same requests in turn in the same process
after the first (the single-worker references of a test module's models: one torch import and
process start for all of them instead of one each).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mindie.contract import wire as P  # noqa: E402
from mindie.contract.spec import EngineConfig, WorkerSpec, decode_spec, encode_spec  # noqa: E402


def make_spec(model: str, world: int) -> WorkerSpec:
    return WorkerSpec(worker_id="w0", job_endpoint="", pub_endpoint="", device_type="cpu",
                      moe_parallel=os.environ.get("TP_TEST_MOE_PARALLEL", "tp"),
                      device_ids=list(range(world)), model_path=model, dtype="float32", cpu_mem_gb=0.02, threads=1,
                      engine=EngineConfig(block_size=16, max_seq_len=512, max_batch_size=16,
                                          max_prefill_batch_size=16, max_prefill_tokens=64, overlap=False,
                                          batch_invariant=os.environ.get("TP_TEST_INVARIANT") == "1"))


def run_rank0(spec: WorkerSpec, store: str, requests: list[dict], out: str) -> None:
    """Rank 0 (or the single worker): build the engine, run ``requests``, write ``out``."""
    from workers.models.loader import parameter_bytes
    from workers.engine.assembly import build

    engine = build(spec, tp_store=store).engine
    result: dict[str, list[int]] = {r["id"]: [] for r in requests}
    logprobs: dict[str, list[float]] = {r["id"]: [] for r in requests}

    def drain() -> None:
        while engine.has_work():
            for o in engine.step():
                result[o.seq.request_id].extend(o.token_ids)
                logprobs[o.seq.request_id].extend(o.logprobs)

    for r in requests:
        engine.add(P.Submit(r["id"], "fe", r["prompt"], P.SamplingParams(**r["params"])))
    drain()
    if os.environ.get("TP_TEST_ALONE") == "1":  # then each again, alone in the engine: id + "/alone"
        for r in requests:
            rid = r["id"] + "/alone"
            result[rid], logprobs[rid] = [], []
            engine.add(P.Submit(rid, "fe", r["prompt"], P.SamplingParams(**r["params"])))
            drain()
    group = engine.runner.group
    if group is not None:
        group.stop()
    Path(out).write_text(json.dumps({"tokens": result, "logprobs": logprobs,
                                     "param_bytes": parameter_bytes(engine.runner.model),
                                     "kv_blocks": engine.blocks.num_blocks}))


def main() -> None:
    model, world, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    requests = json.loads(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[4] == "--requests" else []
    more = json.loads(sys.argv[7]) if len(sys.argv) > 7 and sys.argv[6] == "--more" else []
    if more and world != 1:
        raise SystemExit("--more: single-worker runs only (WORLD 1)")
    rank = int(os.environ.get("TP_TEST_RANK", "-1"))
    if rank < 0:  # the launcher: one process per rank, like the supervisor
        import logging
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        spec = make_spec(model, world)
        store = os.path.join(tempfile.mkdtemp(prefix="tp"), "store") if world > 1 else ""
        procs = []
        for r in range(world):
            env = dict(os.environ, TP_TEST_RANK=str(r), TP_TEST_SPEC=encode_spec(spec), TP_TEST_STORE=store)
            procs.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:]], env=env))
        codes = [p.wait(300) for p in procs]
        raise SystemExit(max(codes))
    spec = decode_spec(os.environ["TP_TEST_SPEC"])
    store = os.environ["TP_TEST_STORE"]
    from workers import settings
    settings.apply(spec.engine)  # as workers.worker does: the modules that read the plan's settings
    from mindie.runtime.log_setup import setup_logging
    setup_logging(f"rank {rank}", "INFO")
    if rank == 0:
        run_rank0(spec, store, requests, out)
        for other, other_out in more:  # WORLD 1: the next model's engine in this process
            run_rank0(make_spec(other, world), store, requests, other_out)
    else:
        from workers.tp_rank import follow
        raise SystemExit(follow(spec, rank, store))


if __name__ == "__main__":
    main()
