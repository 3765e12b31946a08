"""scripts/gpu_check.py rehearsed on CPU: the dry run goes end to end and reports every check.

The GPU run is the same code with the device and the sizes changed, so the dry run proves the
runner (set-up, per-check processes and limits, the budget, JSON / Markdown / archive) and
every check's code path on tiny shapes.
"""

from __future__ import annotations

import json
import numbers
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration
SCRIPT = REPO / "scripts" / "gpu_check.py"
sys.path.insert(0, str(REPO / "scripts"))
import gpu_check  # noqa: E402


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout
    )


def _numbers(figures: dict) -> None:
    for name, value in figures.items():
        assert isinstance(value, numbers.Real) and not isinstance(value, bool), (name, value)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, Path]:
    base = tmp_path_factory.mktemp("gpu-check")
    out, tgz = base / "out", base / "gpu_check.tgz"
    proc = _run("--out", str(out), "--dry-run", "--archive", str(tgz), timeout=660)
    return proc, out, tgz


def test_dry_run_reports_every_check(dry_run) -> None:
    proc, out, _ = dry_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["dry_run"] is True and summary["meta"]["device"] == "cpu"
    checks = {c["name"]: c for c in summary["checks"]}
    assert list(checks) == [c.name for c in gpu_check.CHECKS]
    for name, c in checks.items():
        assert c["status"] in ("ok", "skipped"), (name, c["status"], c["reason"], c.get("log"))
        if c["status"] == "skipped":
            assert c["reason"].startswith("skipped: "), (name, c["reason"])
        _numbers(c["figures"])
        assert isinstance(c["seconds"], float) and c["seconds"] <= c["limit_s"] + 5
        # each check's own files, the same result as in the summary
        own = json.loads((out / f"{name}.json").read_text())
        assert own["status"] == c["status"] and own["figures"] == c["figures"]
        assert (out / f"{name}.md").read_text().startswith(f"## {name}: {c['status']}")
    md = (out / "summary.md").read_text()
    assert all(f"| {name} | {c['status']} |" in md for name, c in checks.items())
    # every open target is set against its figure, measured here (tiny shapes: any value)
    goals = {g["figure"]: g for g in summary["targets"]}
    assert set(goals) == {f"{c}.{f}" for c, f, *_ in gpu_check.TARGETS}
    for g in goals.values():
        assert isinstance(g["value"], float) and isinstance(g["met"], bool), g
    assert "**open targets (dry run" in md


def test_dry_run_measures_on_cpu(dry_run) -> None:
    """The checks that can run on CPU do, with figures of the right kind."""
    _, out, _ = dry_run
    checks = {c["name"]: c for c in json.loads((out / "summary.json").read_text())["checks"]}
    assert checks["env"]["status"] == "ok"
    assert checks["env"]["details"]["cuda_available"] is False
    kernels = checks["kernels"]  # every tests/gpu test skips without CUDA
    assert kernels["status"] == "skipped" and kernels["figures"]["skipped"] >= 1
    assert kernels["figures"]["passed"] == kernels["figures"]["failed"] == 0
    rollout = checks["rollout"]
    assert rollout["status"] == "ok"
    for b in (1, 8, 64):
        assert rollout["figures"][f"b{b}_speedup"] > 0
        assert rollout["figures"][f"b{b}_plain_tok_s"] > 0
    assert rollout["profile"]["per_position"] == pytest.approx(
        [r for r in rollout["tables"][1]["rows"][0][1:]], abs=1e-3
    )  # the replayed conditional rates give back the source profile
    rl = checks["rl_step"]
    assert rl["status"] == "ok"
    for mode in ("cotrain", "none"):
        assert rl["figures"][f"{mode}_step_s"] > 0 and rl["figures"][f"{mode}_rollout_s"] > 0
    assert rl["figures"]["none_draft_update_s"] == 0 < rl["figures"]["cotrain_draft_update_s"]
    assert "projected_step_cotrain_over_none" in rl["figures"]  # from the rollout check's result
    profile = checks["profile"]
    assert profile["status"] == "ok"
    ratio = profile["figures"]["small_measured_over_predicted_memory"]
    assert 0.5 < ratio < 2.0  # the model predicts a measured one-rank step within 2×


def test_archive_holds_the_folder(dry_run) -> None:
    _, out, tgz = dry_run
    with tarfile.open(tgz) as tar:
        names = set(tar.getnames())
    assert f"{out.name}/summary.json" in names and f"{out.name}/summary.md" in names


def test_budget_skips_what_would_not_fit(tmp_path) -> None:
    out, wheels = tmp_path / "out", tmp_path / "wheels"
    wheels.mkdir()
    proc = _run("--out", str(out), "--dry-run", "--budget-s", "1", "--wheels", str(wheels))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["setup"]["wheels"] == {
        "installed": [],
        "note": f"no .whl files in {wheels}",
    }
    checks = summary["checks"]
    assert [c["name"] for c in checks] == [c.name for c in gpu_check.CHECKS]
    assert all(c["status"] == "skipped" and "skipped: budget" in c["reason"] for c in checks)


def test_out_holding_other_files_is_refused(tmp_path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    proc = _run("--out", str(tmp_path), "--dry-run", timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip().startswith("Error: --out") and len(proc.stderr.splitlines()) == 1
    assert (tmp_path / "precious.txt").read_text() == "keep me"
    assert not (tmp_path / "summary.json").exists()


def test_unknown_check_is_a_one_line_error(tmp_path) -> None:
    proc = _run("--out", str(tmp_path / "o"), "--only", "nope", timeout=60)
    assert proc.returncode == 1 and "unknown check(s) nope" in proc.stderr


def test_replayed_acceptance_matches_the_profile() -> None:
    """eagle3_replay against a zero-lm_head (uniform) target is accepted at the profile's
    per-position rates: each measured rate within 4 binomial standard deviations (p ≈ 6e-5 per
    position under the null)."""
    import gpu_check_rollout as gr
    import torch

    from specrl.models.presets import preset_config
    from specrl.rollout import Request, RolloutEngine, SamplingParams, SpecConfig

    per_position = [0.9, 0.6, 0.45, 0.3]
    alphas = gr.conditional_profile(per_position)
    assert gr._rates(alphas) == per_position
    cfg = preset_config("toy-tiny", vocab_size=200)
    target, draft = gr.build_pair(cfg, torch.device("cpu"), torch.float32, 64)
    options = {"eagle3_replay": {"draft": draft, "alphas": alphas}}
    spec = SpecConfig(
        ("eagle3_replay",), max_k=4, draft_lengths=(4,), gate=False, proposer_options=options
    )
    engine = RolloutEngine(target, max_batch_size=16, spec=spec, seed=0, eos_token_ids=())
    prompts = gr._prompts(16, 6, cfg.vocab_size, 0)
    res = engine.generate(
        [Request(p, SamplingParams(48, 1.0, seed=i)) for i, p in enumerate(prompts)]
    )
    stats = res.stats["proposers"]["eagle3_replay"]
    for j, (want, n, hit) in enumerate(
        zip(per_position, stats["position_drafts"], stats["position_accepted"], strict=True)
    ):
        assert n >= 150, (j, n)
        sd = (want * (1 - want) / n) ** 0.5
        assert abs(hit / n - want) <= 4 * sd, (j, hit / n, want, n)
    # every token is still a sample of the uniform target: no id is drafted outside [0, V)
    assert all(0 <= t < cfg.vocab_size for r in res for t in r.tokens)
    greedy = RolloutEngine(target, max_batch_size=2, spec=spec, seed=0, eos_token_ids=())
    with pytest.raises(ValueError, match="requests need T > 0"):
        greedy.generate([Request(prompts[0], SamplingParams(8, 0.0))])


def test_rl_phase_clocks_synchronise_first(monkeypatch) -> None:
    """The rl_step check's phase timers sync the device before reading the clock."""
    import gpu_check_rl

    import specrl.train.loop as loop
    import specrl.train.strategy as strategy

    for module in (loop, strategy):
        monkeypatch.setattr(module, "time", module.time)  # restored after the test
    calls = []
    gpu_check_rl.synced_phase_clocks(lambda: calls.append(1))
    t0 = loop.time.perf_counter()
    assert strategy.time.perf_counter() >= t0 and len(calls) == 2
    assert loop.time.sleep is __import__("time").sleep  # everything else is the time module


def test_a_check_past_its_limit_is_killed_and_reported(tmp_path) -> None:
    """A check still running at its limit is killed (its whole process group) and recorded as
    a timeout failure; what it kept as partial results survives."""
    args = gpu_check.parse(["--out", str(tmp_path), "--dry-run"])
    env = {**__import__("os").environ, "PYTHONPATH": str(REPO / "scripts")}
    res = gpu_check.run_child(gpu_check.BY_NAME["env"], 0.3, args, env)  # torch takes longer
    assert res["status"] == "failed" and res["reason"].startswith("timeout: stopped at its limit")
    assert res["seconds"] < 15 and not (tmp_path / "env.json").exists()
    # a partial result's figures are kept in the failure; a finished result wins over it
    partial, path = gpu_check.partial_path(tmp_path, "x"), tmp_path / "x.json"
    partial.write_text(json.dumps({"figures": {"b1_speedup": 1.5}, "tables": []}))
    res = gpu_check.outcome(None, path, partial, 10.0, "log")
    assert res["status"] == "failed" and res["figures"] == {"b1_speedup": 1.5}
    assert "figures measured before are kept" in res["reason"]
    path.write_text(json.dumps(gpu_check.result("ok", figures={"a": 1})))
    assert gpu_check.outcome(0, path, partial, 10.0, "")["figures"] == {"a": 1}
    assert gpu_check.outcome(3, path, partial, 10.0, "")["status"] == "failed"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_run_without_cuda_says_so(tmp_path) -> None:
    """The GPU run on a machine without CUDA: env fails (exit 1), the CUDA checks skip."""
    out = tmp_path / "out"
    proc = _run("--out", str(out), "--only", "env,profile", "--budget-s", "200")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    checks = {c["name"]: c for c in json.loads((out / "summary.json").read_text())["checks"]}
    assert checks["env"]["status"] == "failed" and checks["env"]["reason"] == "no CUDA device"
    assert checks["profile"]["status"] == "skipped"
    assert "torch sees no CUDA device" in checks["profile"]["reason"]


def test_device_wrapper_leaves_the_summary_and_archive_in_out(tmp_path) -> None:
    """scripts/gpu_check.sh, the device machine's command: summary.md, summary.json and the
    archive land in $OUT (a device machine returns a few files from there)."""
    import os

    dest, work = tmp_path / "OUT", tmp_path / "work"
    dest.mkdir()
    env = {**os.environ, "OUT": str(dest), "GPU_CHECK_OUT": str(work)}
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--dry-run", "--only", "env"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in dest.iterdir()) == ["gpu_check.tgz", "summary.json", "summary.md"]
    summary = json.loads((dest / "summary.json").read_text())
    assert [c["name"] for c in summary["checks"]] == ["env"]
