"""EAGLE-3 draft: shapes, vocab map semantics, efficient TTT == dense reference (float64)."""

from __future__ import annotations

import pytest
import torch

from specrl.core.attention import PackedLayout
from specrl.models.decoder import Transformer
from specrl.models.draft import DraftConfig, Eagle3Draft, build_vocab_map, init_draft_weights
from specrl.models.presets import preset_config
from specrl.train.ttt import teacher_from_logits, ttt_inputs, ttt_loss

V = 41


def make_pair(draft_vocab: int = 29, seed: int = 0, dtype=torch.float64, vocab: int = V):
    tcfg = preset_config("toy-tiny", vocab_size=vocab, num_hidden_layers=3)
    target = Transformer(tcfg).init_weights(seed, std=0.3).to(dtype)
    dcfg = DraftConfig.for_target(tcfg, draft_vocab_size=draft_vocab, tap_layers=(0, 1, 2))
    draft = init_draft_weights(Eagle3Draft(dcfg), seed + 1, std=0.2).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 100, (vocab,), generator=gen)
    draft.set_vocab_map(build_vocab_map(counts, draft_vocab))
    draft.refresh_embedding(target.model.embed_tokens.weight)
    return target, draft


def test_vocab_map_semantics():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    ids = build_vocab_map(counts, 4)
    assert ids.tolist() == [0, 2, 3, 5]  # top-4 by count, sorted by id
    _, draft = make_pair(draft_vocab=4)
    draft.set_vocab_map(ids)
    assert draft.d2t.tolist() == [0, 1, 1, 2]  # draft id i ↦ target id i + d2t[i]
    assert (torch.arange(4) + draft.d2t).tolist() == [0, 2, 3, 5]
    assert draft.t2d.nonzero().flatten().tolist() == [0, 2, 3, 5]
    # ties break toward lower ids, unseen ids fill the rest
    assert build_vocab_map(torch.tensor([1, 1, 0, 0, 1]), 4).tolist() == [0, 1, 2, 4]
    # full vocabulary: d2t all zero
    full = build_vocab_map(counts, 8)
    assert full.tolist() == list(range(8))
    with pytest.raises(ValueError):
        draft.set_vocab_map(torch.tensor([0, 0, 1, 2]))


def test_config_guards():
    tcfg = preset_config("toy-tiny", vocab_size=V)
    with pytest.raises(ValueError, match="out of range"):
        DraftConfig.for_target(tcfg, tap_layers=(0, 1, 2))  # toy-tiny has 2 layers
    with pytest.raises(ValueError, match="exactly 3"):
        DraftConfig.for_target(tcfg, tap_layers=(0, 1))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        DraftConfig.for_target(tcfg, draft_vocab_size=V + 1, tap_layers=(0, 0, 1))


def _batch(lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (sum(lens),), generator=gen)
    mask = (torch.rand(sum(lens), generator=gen) > 0.2).double()
    return ids, PackedLayout.from_lengths(lens), mask


def _run(target, draft, ids, layout, mask, steps, attn, kind="ce"):
    out = target(ids, layout, taps=draft.config.tap_layers)
    taps = Eagle3Draft.concat_taps(out.taps, draft.config.tap_layers).requires_grad_(True)
    inputs = ttt_inputs(ids, mask, layout, steps)
    res = draft.ttt_forward(taps, inputs.step_ids, layout, attn=attn)
    loss = ttt_loss(res, teacher_from_logits(out.logits, draft), inputs, layout, kind=kind)
    params = [p for p in draft.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss.loss, [*params, taps])
    return loss, res, grads


@pytest.mark.parametrize("steps", [1, 3, 7])
@pytest.mark.parametrize("kind", ["ce", "tv"])
def test_efficient_ttt_equals_dense_reference_fp64(steps, kind):
    target, draft = make_pair()
    ids, layout, mask = _batch([1, 9, 4, 1, 13, 2, 6])
    l_ref, o_ref, g_ref = _run(target, draft, ids, layout, mask, steps, "reference", kind)
    l_eff, o_eff, g_eff = _run(target, draft, ids, layout, mask, steps, "efficient", kind)
    assert abs(l_ref.loss.item() - l_eff.loss.item()) <= 1e-12
    assert l_ref.acc == l_eff.acc and l_ref.count == l_eff.count
    for a, b in zip(o_ref.logits, o_eff.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    assert len(g_ref) == len(g_eff)
    for a, b in zip(g_ref, g_eff, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    assert any(g.abs().sum() > 0 for g in g_eff)


def test_shapes_and_embedding_frozen():
    target, draft = make_pair(dtype=torch.float32)
    ids, layout, mask = _batch([5, 3])
    loss, res, _ = _run(target, draft, ids, layout, mask, 3, "efficient")
    assert len(res.logits) == 3 and res.logits[0].shape == (8, 29)
    assert res.hidden[0].shape == (8, draft.config.hidden_size)
    assert not draft.embed_tokens.weight.requires_grad
    assert len(loss.acc) == 3 and 1.0 <= loss.tau <= 4.0


def test_shift_never_crosses_sequence_boundary():
    ids = torch.arange(10)
    layout = PackedLayout.from_lengths([3, 1, 6])
    inp = ttt_inputs(ids, torch.ones(10), layout, 2)
    # step 0 token at t is x_{t+1} within the sequence, 0 (masked) past the end
    assert inp.step_ids[0].tolist() == [1, 2, 0, 0, 5, 6, 7, 8, 9, 0]
    assert inp.step_mask[0].tolist() == [1, 1, 0, 0, 1, 1, 1, 1, 1, 0]
    assert inp.step_ids[1].tolist() == [2, 0, 0, 0, 6, 7, 8, 9, 0, 0]


def test_teacher_outside_draft_vocab_is_masked():
    _, draft = make_pair(draft_vocab=5)
    logits = torch.full((3, V), -5.0, dtype=torch.float64)
    logits[0, draft.draft_to_target[2]] = 5.0
    outside = int((~draft.t2d).nonzero()[0])
    logits[1, outside] = 5.0
    logits[2, draft.draft_to_target[0]] = 5.0
    teacher = teacher_from_logits(logits, draft)
    assert teacher.in_vocab.tolist() == [1.0, 0.0, 1.0]
    assert teacher.logits.shape == (3, 5)
