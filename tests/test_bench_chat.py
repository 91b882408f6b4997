"""``mindie-bench run --workload chat`` against the real server (the session's default-model server,
SmolLM2-135M-Instruct): real questions through POST /v1/chat/completions, answers of their own
lengths, counted as the server's usage counts them; one answer checked against the OpenAI client."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mindie_bench import cli
from mindie_bench.workload import chat_specs
from tests.harness import default_model_server
from tests.lazy_modules import lazy_module

openai = lazy_module("openai")  # imported where a test uses it (tests/lazy_modules.py)

pytestmark = pytest.mark.timeout(300)

CAP = 48  # max_tokens: small for CI time; several of the questions below end well before it
SEED = 3


@pytest.fixture(scope="module")
def srv(demo_servers):
    return default_model_server(demo_servers)


def test_chat_workload_against_the_server(srv, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["run", "--workload", "chat", "--url", srv.url, "--num-prompts", "4", "--concurrency", "2",
                   "--output-len", str(CAP), "--warmup", "0", "--seed", str(SEED), "--out", str(tmp_path),
                   "--no-progress", "--quiet"])
    assert rc == 0, capsys.readouterr()
    doc = json.loads(next(tmp_path.glob("run-chat-*.json")).read_text())
    assert doc["endpoint"]["api"] == "chat" and doc["endpoint"]["url"] == srv.url + "/v1/chat/completions"
    assert doc["endpoint"]["ignore_eos"] is False
    point = doc["points"][0]
    reqs = point["requests"]
    assert len(reqs) == 4 and all(r["ok"] for r in reqs), [r["error"] for r in reqs]
    lengths = [r["output_tokens"] for r in reqs]
    # Answers of their own length: greedy, no ignore_eos, so the model ends some before the cap.
    assert all(0 < n <= CAP for n in lengths) and len(set(lengths)) > 1 and min(lengths) < CAP, lengths
    assert all(r["prompt_tokens"] > len(q.prompt_text.split()) for r, q in zip(reqs, chat_specs(4, SEED)))
    st = point["stats"]
    assert st["completed"] == 4 and st["total_output_tokens"] == sum(lengths) and st["output_throughput"] > 0
    assert st["output_len"]["min"] == min(lengths) and st["ttft_ms"]["p50"] > 0 and st["itl_ms"]["n"] > 0

    # The shortest answer, asked again through the OpenAI client: the same greedy length.
    i = lengths.index(min(lengths))
    q = chat_specs(4, SEED)[reqs[i]["index"]].prompt_text
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": q}], max_tokens=CAP,
                                         temperature=0)
    assert out.choices[0].finish_reason == "stop" and out.choices[0].message.content
    assert out.usage.completion_tokens == lengths[i]
