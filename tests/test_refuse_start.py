"""Refuse what cannot start (issue 27, item 7), on the real launch script:

- a model the server cannot load (an unsupported model type, a missing weight file, a truncated
  file, a tensor of the wrong shape) is refused by the launch step (workers/prepare.py) with exit
  status 2 and a message naming the file or key, before any process starts;
- a worker that fails at start in a way only it can see (here: its tcp port held by another
  program) stops the server after ``START_ATTEMPTS`` tries (workers/supervisor.py), within a
  bounded time, with the worker's reason as the supervisor's last line, and the run directory
  left clean;
- a worker killed while serving is restarted however often it dies.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from mindie.contract.spec import WorkerSpec
from mindie.runtime import lifecycle
from tests.harness import Server, alive, descendants, free_port, short_run_dir, wait_gone, write_config
from tests.test_worker_curve import port_pair
from workers.supervisor import START_ATTEMPTS

pytestmark = pytest.mark.timeout(240)

KEY = "BackendConfig.ModelDeployConfig.ModelConfig[0].modelWeightPath"
SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def _copy_model(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _with_tokenizer(model: Path, demo_model: str) -> Path:
    """A checkpoint whose tokenizer loads (the front ends' check passes): the launch step's
    refusal is then the model's."""
    shutil.copy(Path(demo_model) / "tokenizer.json", model / "tokenizer.json")
    return model


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory, demo_model) -> dict[str, tuple[Path, str]]:
    """name -> (model directory, what the launch step must say about it)."""
    from safetensors.torch import load_file, save_file

    from tests.tiny_hf import save_random_model
    from workers.models.config import SUPPORTED_ARCHS

    root = tmp_path_factory.mktemp("bad-models")
    out = {}
    # Real (tiny) checkpoints of two families the decoder does not implement.
    save_random_model("OlmoeConfig", dict(SMALL, num_experts=4, num_experts_per_tok=2), root / "olmoe")
    out["olmoe"] = (_with_tokenizer(root / "olmoe", demo_model),
                    "model_type: unsupported model type 'olmoe' (supported: "
                    f"{', '.join(sorted(k for k in SUPPORTED_ARCHS if k.islower()))})")
    save_random_model("StableLmConfig", dict(SMALL, pad_token_id=0, bos_token_id=1, eos_token_id=2), root / "stablelm")
    out["stablelm"] = (_with_tokenizer(root / "stablelm", demo_model), "model_type: unsupported model type 'stablelm'")

    # The demo checkpoint split in two shards with an index, the second shard missing.
    tensors = load_file(str(Path(demo_model) / "model.safetensors"))
    missing = _copy_model(demo_model, root / "missing_shard")
    (missing / "model.safetensors").unlink()
    names = sorted(tensors)
    half = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
            "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    save_file({n: tensors[n] for n in half["model-00001-of-00002.safetensors"]},
              str(missing / "model-00001-of-00002.safetensors"))
    (missing / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, ns in half.items() for n in ns}}))
    out["missing_shard"] = (missing, f"names shard(s) that do not exist: {missing}/model-00002-of-00002.safetensors")

    # The file cut short, as an interrupted copy leaves it.
    truncated = _copy_model(demo_model, root / "truncated")
    size = os.path.getsize(truncated / "model.safetensors")
    os.truncate(truncated / "model.safetensors", size // 2)
    out["truncated"] = (truncated, f"{truncated}/model.safetensors: not a readable safetensors file: "
                                   f"Error while deserializing header: incomplete metadata, file not fully covered "
                                   f"(the file has {size // 2} bytes, its header describes {size}: truncated?)")

    # One tensor of another shape than config.json implies.
    shape = _copy_model(demo_model, root / "wrong_shape")
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"].t().contiguous()
    save_file(tensors, str(shape / "model.safetensors"))
    out["wrong_shape"] = (shape, f"{shape}/model.safetensors: tensor model.layers.1.mlp.down_proj.weight has shape "
                                 "(688, 256), config.json implies (256, 688)")
    return out


def launch_refused(tmp_path, model, **config) -> tuple[int, str, str]:
    """launch.sh on ``model``, expected to stop by itself: (exit status, its log, the run dir)."""
    port, run_dir = free_port(), short_run_dir()
    srv = Server(write_config(tmp_path / "config.json", port=port, run_dir=run_dir, workers=1,
                              model_path=str(model), **config), port)
    try:
        status = srv.proc.wait(60)
    finally:
        srv.stop()
    return status, srv.log_path.read_text(), run_dir


# On the real launch script: one unsupported family (ModelArgs' refusal) and one broken weight
# file (the checkpoint check's): the two ways workers/prepare.py's check_model refuses. Their path
# from there (exit status 2, "config error: ", no process started, the run directory left clean)
# is one for every refusal; the other cases are the same check's messages, asserted in process
# below (test_a_model_that_cannot_load_is_refused_by_the_launch_steps_check), a launch each less.
LAUNCHED = ["olmoe", "truncated"]


@pytest.mark.parametrize("name", LAUNCHED)
def test_a_model_that_cannot_load_is_refused_before_anything_starts(tmp_path, bad_models, name):
    model, message = bad_models[name]
    status, log, run_dir = launch_refused(tmp_path, model)
    assert status == 2, log
    assert f"config error: {KEY}: {model} cannot be served: " in log, log
    assert message in log, log
    # No process was started: neither the supervisor nor a worker nor gunicorn.
    assert "launch.sh: supervisor pid" not in log and "started worker" not in log and "Booting worker" not in log, log
    assert lifecycle.leftovers(run_dir) == [], log


@pytest.mark.parametrize("name", ["stablelm", "missing_shard", "wrong_shape"])
def test_a_model_that_cannot_load_is_refused_by_the_launch_steps_check(bad_models, name):
    """The launch step's model check (workers/prepare.py check_model, what launch.sh runs through
    ``python -m workers.prepare``; its exit path is the launched cases' above) refuses each
    defect with the message naming the file or key."""
    from workers.prepare import check_model

    model, message = bad_models[name]
    spec = WorkerSpec(worker_id="w0", job_endpoint="", pub_endpoint="", device_type="cpu", device_ids=[0])
    with pytest.raises(SystemExit) as e:
        check_model([spec], str(model))
    assert str(e.value.code).startswith(f"{KEY}: {model} cannot be served: "), e.value.code
    assert message in str(e.value.code), e.value.code


def test_the_launch_step_reads_headers_only(tmp_path, caplog):
    """A 13 GiB checkpoint (a Llama-2-7B shape, bf16, as sparse files: nothing on disk) is
    checked from its headers in well under a second, and the check says what it checked; the
    same checkpoint with one tensor stored as int8 (a pre-quantised checkpoint) is refused."""
    from workers.models.checkpoint import expected_tensors
    from workers.models.config import ModelArgs
    from workers.prepare import check_model

    cfg = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
           "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
    shapes = expected_tensors(ModelArgs.from_dict(cfg))

    def write(model: Path, int8: str = "") -> None:
        model.mkdir()
        (model / "config.json").write_text(json.dumps(cfg))
        names = sorted(shapes)
        for i, part in enumerate((names[:len(names) // 2], names[len(names) // 2:])):
            header, offset = {}, 0
            for n in part:
                size = (1 if n == int8 else 2) * math.prod(shapes[n])
                header[n] = {"dtype": "I8" if n == int8 else "BF16", "shape": list(shapes[n]),
                             "data_offsets": [offset, offset + size]}
                offset += size
            raw = json.dumps(header).encode()
            raw += b" " * (-len(raw) % 8)
            with open(model / f"model-{i}.safetensors", "wb") as f:
                f.write(len(raw).to_bytes(8, "little") + raw)
                f.truncate(8 + len(raw) + offset)  # sparse: the data is a hole

    write(tmp_path / "big")
    spec = WorkerSpec(worker_id="w0", job_endpoint="", pub_endpoint="", device_type="cpu", device_ids=[0])
    with caplog.at_level(logging.INFO, logger="workers.prepare"):
        t0 = time.perf_counter()
        check_model([spec], str(tmp_path / "big"))
        elapsed = time.perf_counter() - t0
    assert elapsed < 1.0, elapsed
    line = caplog.records[-1].getMessage()
    assert re.search(r"model check: .*/big is llama \(32 layers, vocab 32000\), 2 weight file\(s\) with the 291 "
                     r"tensors it needs, 12852\.\d MiB, headers only; in \d\.\d\d s", line), line

    write(tmp_path / "int8", int8="model.layers.3.mlp.up_proj.weight")
    with pytest.raises(SystemExit, match=r"int8/model-\d\.safetensors: tensor model\.layers\.3\.mlp\.up_proj\.weight "
                                         r"is stored as I8; only floating-point weights"):
        check_model([spec], str(tmp_path / "int8"))


def test_a_tokenizer_that_does_not_load_is_refused(tmp_path, demo_model):
    model = _copy_model(demo_model, tmp_path / "no-tokenizer")
    (model / "tokenizer.json").write_text("{not json")
    status, log, run_dir = launch_refused(tmp_path, model)
    assert status == 2, log
    assert f"config error: {KEY}: {model}: the tokenizer does not load from {model}/tokenizer.json: " in log, log
    assert "launch.sh: supervisor pid" not in log and "started worker" not in log, log
    assert lifecycle.leftovers(run_dir) == [], log


def test_a_device_that_is_not_there_is_refused(tmp_path, demo_model, monkeypatch):
    """deviceType cuda, device 99: refused by the launch step through the CUDA backend's own
    check (no CUDA device on a CPU host; on a GPU host, past its last device)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the count is checked only without it
    port, run_dir = free_port(), short_run_dir()
    cfg = write_config(tmp_path / "config.json", port=port, run_dir=run_dir, workers=1, model_path=demo_model)
    data = json.loads(cfg.read_text())
    data["BackendConfig"].update(deviceType="cuda", npuDeviceIds=[[99]])
    cfg.write_text(json.dumps(data, indent=2))
    srv = Server(cfg, port)
    try:
        status = srv.proc.wait(60)
    finally:
        srv.stop()
    log = srv.log_path.read_text()
    assert status == 2, log
    assert ("config error: BackendConfig.deviceType: deviceType is cuda but torch sees no CUDA device" in log
            or re.search(r"config error: BackendConfig\.npuDeviceIds: device 99 does not exist: this host has \d+ "
                         r"cuda device\(s\)", log)), log
    assert "launch.sh: supervisor pid" not in log and "started worker" not in log, log
    assert lifecycle.leftovers(run_dir) == [], log


@pytest.mark.parametrize("tp", [False, True], ids=["one-process", "tensor-parallel"])
def test_a_worker_that_cannot_start_stops_the_server(tmp_path, demo_model, tp):
    """The worker's tcp port is held by another program: something only the worker finds out
    (after its model loaded). Each start fails; after START_ATTEMPTS the supervisor exits 2 with
    the worker's reason as its last line, the launcher stops everything, and nothing is left."""
    wport = port_pair(1)
    holder = socket.socket()
    holder.bind(("127.0.0.1", wport))
    holder.listen()
    port, run_dir = free_port(), short_run_dir()
    cfg = write_config(tmp_path / "config.json", port=port, run_dir=run_dir, workers=1, model_path=demo_model,
                       model={"worldSize": 2} if tp else None)
    data = json.loads(cfg.read_text())
    data["BackendConfig"].update(workerHost="127.0.0.1", workerPort=wport, workerInsecureTcp=True)
    if tp:
        data["BackendConfig"]["npuDeviceIds"] = [[0, 1]]
    cfg.write_text(json.dumps(data, indent=2))
    t0 = time.monotonic()
    srv = Server(cfg, port)
    seen: set[int] = set()
    try:
        while srv.proc.poll() is None and time.monotonic() - t0 < 150:
            seen |= set(descendants(srv.proc.pid))
            time.sleep(0.2)
        status = srv.proc.wait(30)
        elapsed = time.monotonic() - t0
    finally:
        srv.stop()
        holder.close()
    log = srv.log_path.read_text()
    assert status == 2, log
    assert wait_gone(seen, 5) is not None, [p for p in seen if alive(p)]
    reason = (f"cannot bind tcp://127.0.0.1:{wport}: address already in use (another worker or program holds this "
              "port: BackendConfig.workerPort picks the ports)")
    assert log.count("started worker w0") == START_ATTEMPTS, log
    assert log.count("before it was ready") == START_ATTEMPTS, log
    for n in range(1, START_ATTEMPTS):
        assert f"(start failure {n} of {START_ATTEMPTS})" in log, log
    sup_lines = [line for line in log.splitlines() if "[supervisor" in line]
    last = f"worker w0 failed to start {START_ATTEMPTS} times in a row, the last time: "
    last += f"rank 0: {reason}" if tp else reason
    assert sup_lines[-1].endswith(f"{last}: the server stops (supervisor exit status 2)"), sup_lines[-5:]
    assert re.search(r"launch\.sh: the device-worker supervisor \(pid \d+\) exited with status 2: a device worker "
                     r"cannot start \(its reason is the supervisor.s last line above\): stopping the server",
                     log), log
    assert "(exit status 2)" in log.splitlines()[-1], log
    assert lifecycle.leftovers(run_dir) == [], log
    assert not list(Path(run_dir).glob("*.store")), os.listdir(run_dir)
    # Bounded: three model loads and the 0.5 + 1 s backoffs, not an endless loop.
    assert elapsed < 120, elapsed


def test_a_worker_killed_while_serving_is_restarted_however_often(tmp_path, demo_model):
    """Deaths after the worker was ready are not start failures: more than START_ATTEMPTS kills
    in a row, each after the worker served, and the server still serves."""
    port, run_dir = free_port(), short_run_dir()
    srv = Server(write_config(tmp_path / "config.json", port=port, run_dir=run_dir, workers=1,
                              model_path=demo_model), port)
    try:
        srv.wait_ready(120)
        for _ in range(START_ATTEMPTS + 1):
            deadline = time.monotonic() + 60
            while True:  # served by the current worker, so it is ready
                try:
                    r = httpx.post(srv.url + "/infer_token", json={"input_id": [1, 2],
                                                                   "parameters": {"max_new_tokens": 2}}, timeout=30)
                    if r.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, srv.tail()
                time.sleep(0.2)
            (pid,) = srv.workers()
            os.kill(pid, signal.SIGKILL)
            assert wait_gone([pid], 5) is not None
        deadline = time.monotonic() + 60
        while not srv.workers() or httpx.post(srv.url + "/infer_token", json={
                "input_id": [1, 2], "parameters": {"max_new_tokens": 2}}, timeout=30).status_code != 200:
            assert time.monotonic() < deadline, srv.tail()
            time.sleep(0.2)
        assert srv.proc.poll() is None
    finally:
        assert srv.stop() == 0, srv.tail()
    log = srv.log_path.read_text()
    assert f"restart #{START_ATTEMPTS + 1})" in log, log
    assert "before it was ready" not in log and "failed to start" not in log, log
    assert lifecycle.leftovers(run_dir) == [], log


def test_an_empty_model_folder_says_what_is_missing(tmp_path, demo_model):
    """Issue 52 finding 9: modelWeightPath naming an empty folder is refused naming what a model
    folder needs and this one lacks, not as a tokenizer that does not load; a folder with the
    tokenizer only names the other two."""
    empty = tmp_path / "empty-model"
    empty.mkdir()
    status, log, run_dir = launch_refused(tmp_path, empty)
    assert status == 2, log
    assert (f"config error: {KEY}: {empty} is not a model folder: no config.json, no *.safetensors weights, "
            f"no tokenizer.json (the folder is empty; ") in log, log
    assert "tokenizer does not load" not in log and "launch.sh: supervisor pid" not in log, log
    assert lifecycle.leftovers(run_dir) == [], log
    (tmp_path / "tokenizer-only").mkdir()
    partial = _with_tokenizer(tmp_path / "tokenizer-only", demo_model)
    status, log, _ = launch_refused(tmp_path, partial)
    assert status == 2, log
    assert f"{partial} is not a model folder: no config.json, no *.safetensors weights (a Hugging Face" in log, log
