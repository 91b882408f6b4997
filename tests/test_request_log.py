"""Request logs (issue 12 item 8): one line per request at INFO with its id, endpoint, tokens,
TTFT, duration and how it ended; JSON lines when LogConfig.logFormat says so; LogConfig.logPath,
logFileSize and logFileNum applied (a rotated file per process)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import httpx
import pytest

from tests.harness import ROOT, Server, free_port, short_run_dir, write_config

pytestmark = pytest.mark.timeout(300)


def _lines(log_dir) -> list[dict]:
    out = []
    for name in sorted(os.listdir(log_dir)):
        with open(os.path.join(log_dir, name), encoding="utf-8") as f:
            for line in f:
                out.append(json.loads(line))  # every line of every file is one JSON object
    return out


def test_request_lines_as_json_in_log_files(tmp_path, demo_model):
    port = free_port()
    log_dir = tmp_path / "logs"
    cfg = write_config(tmp_path / "config.json", port=port, run_dir=short_run_dir(), model_path=demo_model, workers=1)
    raw = json.loads(cfg.read_text())
    raw["LogConfig"] = {"logFormat": "json", "logPath": str(log_dir), "logFileSize": 1, "logFileNum": 2}
    cfg.write_text(json.dumps(raw))
    srv = Server(cfg, port, frontends=1)
    try:
        srv.wait_ready(120)
        ok = httpx.post(srv.url + "/infer", headers={"req-id": "ok-1"}, timeout=30, json={
            "inputs": "hello", "parameters": {"max_new_tokens": 7, "ignore_eos": True}})
        assert ok.status_code == 200 and ok.headers["req-id"] == "ok-1"
        with httpx.stream("POST", srv.url + "/infer_token", headers={"req-id": "st-1"}, timeout=30, json={
                "input_id": [5, 6, 7, 8], "stream": True, "parameters": {"max_new_tokens": 5, "ignore_eos": True}}) as r:
            assert r.headers["req-id"] == "st-1"
            b"".join(r.iter_bytes())
        bad = httpx.post(srv.url + "/infer", headers={"req-id": "bad-1"}, json={"inputs": ""}, timeout=30)
        assert bad.status_code == 422 and bad.headers["req-id"] == "bad-1"
        # One stopped by stopInfer.
        started = threading.Event()

        def long():
            with httpx.stream("POST", srv.url + "/infer", headers={"req-id": "cut-1"}, timeout=60, json={
                    "input_id": [5, 6], "stream": True, "parameters": {"max_new_tokens": 400, "ignore_eos": True}}) as r:
                for _ in r.iter_bytes():
                    started.set()

        t = threading.Thread(target=long)
        t.start()
        assert started.wait(30)
        assert httpx.post(srv.url + "/v2/models/demo/stopInfer", json={"id": "cut-1"}, timeout=10).status_code == 200
        t.join(30)
    finally:
        assert srv.stop() == 0
    lines = _lines(log_dir)
    names = sorted(os.listdir(log_dir))
    assert any(n.startswith("mindie-frontend-") for n in names), names
    assert any(n.startswith("mindie-worker-w0-") for n in names), names
    assert any(n.startswith("mindie-supervisor-") for n in names), names
    reqs = {r["request_id"]: r for r in lines if r.get("logger") == "mindie.request"}
    assert set(reqs) == {"ok-1", "st-1", "bad-1", "cut-1"}, reqs
    ok = reqs["ok-1"]
    assert (ok["endpoint"], ok["status"], ok["output_tokens"], ok["finish_reason"], ok["stream"]) == \
        ("/infer", 200, 7, "length", False)
    assert ok["input_tokens"] > 0 and 0 < ok["ttft_ms"] <= ok["duration_ms"]
    st = reqs["st-1"]
    assert (st["endpoint"], st["input_tokens"], st["output_tokens"], st["stream"]) == ("/infer_token", 4, 5, True)
    bad = reqs["bad-1"]
    assert bad["status"] == 422 and "inputs" in bad["error"].lower() and bad["output_tokens"] == 0
    cut = reqs["cut-1"]
    assert cut["finish_reason"] == "stop_sequence" and 0 < cut["output_tokens"] < 400
    for r in lines:
        assert {"time", "level", "process", "pid", "logger", "message"} <= set(r), r


def test_text_request_line_and_rotation(tmp_path):
    """The text form of a request line; files rotate at logFileSize MB keeping logFileNum."""
    code = f"""
import logging, os
from mindie.runtime.log_setup import setup_logging
from mindie.server.request_log import RequestRecord
setup_logging("frontend pid 1", env={{"MINDIE_LOG_PATH": {str(tmp_path)!r}, "MINDIE_LOG_FILE_SIZE": "1",
                                     "MINDIE_LOG_FILE_NUM": "2"}})
rec = RequestRecord("r-9", "/infer")
rec.input_tokens = 3
rec.token(2)
rec.done(200, "length")
rec.done(500, error="twice")  # logged once
big = "x" * 1000
for _ in range(4000):
    logging.getLogger("t").info(big)
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    first = [ln for ln in proc.stderr.splitlines() if "mindie.request" in ln]
    assert len(first) == 1, first
    line = first[0]
    assert "INFO [frontend pid 1] mindie.request: request r-9 /infer status=200 in=3 out=2 ttft=" in line
    assert line.endswith("finish=length")
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 3, files  # the file and its 2 rotated copies
    for f in files:
        assert os.path.getsize(tmp_path / f) <= (1 << 20) + 2048
