"""profile-parallelism knows ``policy.backend``: the layouts Megatron-core cannot run are
rejected with their reason, on CPU and on GPUs."""

from __future__ import annotations

from specrl.profiling.layouts import Layout, check_layout, enumerate_layouts

JOB = dict(num_layers=8, tied_embeddings=False, seq_len=4096, micro_batch=1, global_batch=8)


def test_megatron_rules_per_layout():
    megatron = lambda layout, **kw: check_layout(layout, **{**JOB, "backend": "megatron", **kw})
    assert "pp ≥ 2" in megatron(Layout(8, 1, 1), schedule="1f1b")
    assert "no gpipe" in megatron(Layout(4, 1, 2), schedule="gpipe")
    assert megatron(Layout(4, 1, 2), schedule="1f1b") is None
    assert megatron(Layout(2, 2, 2), schedule="1f1b") is None  # GPUs: TE's CP attention
    assert "Transformer Engine" in megatron(Layout(2, 2, 2), schedule="1f1b", cuda=False)
    # interleaved: dp 4 × mb 1 of 8 sequences → 2 microbatches per replica < pp = 4
    assert "≥ pp = 4" in megatron(Layout(4, 1, 4, 2), schedule="interleaved")
    assert megatron(Layout(1, 1, 4, 2), schedule="interleaved") is None  # 8 microbatches
    # the native backend runs every one of these
    for layout, schedule in [(Layout(8, 1, 1), "1f1b"), (Layout(4, 1, 2), "gpipe"),
                             (Layout(4, 1, 4, 2), "interleaved")]:  # fmt: skip
        assert check_layout(layout, **JOB, schedule=schedule) is None


def test_megatron_candidates_on_cpu_have_no_cp():
    ok, rejected = enumerate_layouts(8, **JOB, backend="megatron", cuda=False)
    assert ok and all(layout.pp >= 2 and layout.cp == 1 for layout in ok)
    reasons = {str(r.layout): r.reason for r in rejected}
    assert "Transformer Engine" in reasons["dp2·cp2·pp2"]
    native, _ = enumerate_layouts(8, **JOB, cuda=False)
    assert set(ok) < set(native)


def test_profile_parallelism_backend_flag():
    """``specrl profile-parallelism --backend megatron`` ranks only what Megatron-core runs."""
    import json

    from tests.conftest import run_cli

    args = ["--json", "profile-parallelism", "--model", "llama-8b", "--seq-len", "4096"]
    proc = run_cli(*args, "--gpus", "8", "--backend", "megatron", "--top", "50")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["workload"]["backend"] == "megatron"
    assert report["candidates"] and all(c["pp"] >= 2 for c in report["candidates"])
    assert any("needs pp ≥ 2" in r["reason"] for r in report["rejected"])
    small = ["--model", "toy-small", "--seq-len", "64", "--gpus", "2", "--hardware", "cpu"]
    proc = run_cli("profile-parallelism", *small, "--backend", "megatron", "--measure")
    assert proc.returncode == 1 and "not Megatron-core's" in proc.stderr
