"""``specrl rollout --backend vllm``: plain vLLM from the CLI, greedy outputs equal to the embedded
engine's from the same prompt file; a missing backend is a one-line error naming pip."""

from __future__ import annotations

import json

from tests.conftest import run_cli
from tests.vllm.conftest import vllm_marks
from tests.vllm.test_vllm_generation import greedy_embedded

pytestmark = vllm_marks()


def test_rollout_backend_vllm_plain_greedy_equals_embedded(toy_pair, tmp_path):
    prompts = ["12+34=", "905+7=", "48+350="]
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    out = tmp_path / "out.jsonl"
    proc = run_cli(
        "--json", "rollout", "--backend", "vllm", "--target", str(toy_pair.target),
        "--prompts", str(src), "--out", str(out), "--temperature", "0", "--max-tokens", "32",
        "--proposers", "none",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["backend"] == "vllm" and summary["samples"] == 3
    assert summary["speculation"]["method"] is None
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ours = greedy_embedded(toy_pair.target, prompts)
    assert [r["tokens"] for r in rows] == [r.tokens for r in ours]
    assert [r["text"] for r in rows] == [r.text for r in ours]
