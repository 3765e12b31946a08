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
