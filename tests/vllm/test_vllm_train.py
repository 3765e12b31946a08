"""``specrl train`` with ``rollout.backend: vllm`` (recipes/tests/vllm.yaml).

- The session's toy pair was made by ``specrl train`` on this recipe (warm-start → init-draft →
  RL with the draft co-trained and pushed into vLLM after every step → checkpoints): its metrics
  carry τ from vLLM's drafter and the train/inference mismatch; ``--resume`` continues it.
- In process: after a trainer step, the hot-updated vLLM engine generates exactly what the
  embedded engine generates from that step's checkpoint (greedy).
"""

from __future__ import annotations

import json

from tests.conftest import REPO, run_cli
from tests.vllm.conftest import RECIPE, vllm_marks
from tests.vllm.test_vllm_generation import greedy_embedded, task_prompts

pytestmark = vllm_marks()


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_train_run_used_vllm_with_cotrained_draft(toy_pair):
    recs = _records(toy_pair.run)
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert r["tau"] is not None and r["tau"] > 1.2, r  # vLLM's eagle3 drafter, accepted
        assert r["tau_by_proposer"].keys() == {"eagle3"}
        # the trainer recomputes what vLLM sampled: fp32 kernels differ, weights must not
        assert r["logp_gap_mean"] < 1e-2 and r["logp_gap_max"] < 0.1, r
        assert r["draft_loss"] is not None  # co-trained
    assert (toy_pair.run / "checkpoints" / "latest").read_text().strip() == "step-000002"


def test_resume_continues_the_vllm_run(toy_pair):
    sets = [
        "--set", f"policy.path={toy_pair.target}",
        "--set", f"draft.path={toy_pair.drafts['reduced']}",
        "--set", f"run.out_dir={toy_pair.run}", "--set", "train.steps=3",
    ]  # fmt: skip
    proc = run_cli("train", str(RECIPE), *sets, "--resume", cwd=REPO, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = _records(toy_pair.run)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert recs[-1]["tau"] > 1.2 and recs[-1]["logp_gap_max"] < 0.1


def test_hot_updated_vllm_equals_embedded_from_the_step_checkpoint(toy_pair, tmp_path):
    from specrl.cli.common import load
    from specrl.rollout import Request, SamplingParams
    from specrl.train import checkpoint as ckpt
    from specrl.train.loop import build_trainer

    recipe = load(
        RECIPE,
        [
            f"policy.path={toy_pair.target}",
            f"draft.path={toy_pair.drafts['reduced']}",
            f"run.out_dir={tmp_path / 'run'}",
            "train.steps=1",
            "checkpoint.every=1",
        ],
    )
    trainer = build_trainer(recipe)
    try:
        trainer.run()
        assert trainer.engine.policy_version == 1 and trainer.engine.draft_version == 1
        step = ckpt.latest(tmp_path / "run")
        prompts = task_prompts(8, seed=9)
        ours = greedy_embedded(step / "policy", prompts, max_tokens=40)
        res = trainer.engine.generate(
            [Request(p, SamplingParams(max_tokens=40, temperature=0)) for p in prompts]
        )
        assert [r.tokens for r in res] == [r.tokens for r in ours]
    finally:
        trainer.engine.close()
