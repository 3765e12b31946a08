"""Inference fusion of q/k/v and gate/up (``FusedLinears``): same outputs, weights held once,
in-place weight updates seen, stale fusions repaired, autograd and checkpoints untouched."""

from __future__ import annotations

import copy

import pytest
import torch

from specrl.core.attention import PackedLayout
from specrl.models.checkpoint import load_model, save_model
from specrl.models.decoder import Transformer
from specrl.models.draft_io import draft_state
from specrl.models.presets import preset_config
from tests.unit.test_draft import make_pair

LENS = [1, 7, 3, 12]


def _model(**over) -> Transformer:
    cfg = preset_config("toy-tiny", vocab_size=61, **over)
    return Transformer(cfg).init_weights(3, std=0.2).double().eval()


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 61, (sum(LENS),), generator=torch.Generator().manual_seed(seed))


def _logits(model: Transformer) -> torch.Tensor:
    with torch.no_grad():
        return model(_ids(), PackedLayout.from_lengths(LENS)).logits


@pytest.mark.parametrize("over", [{}, {"attention_bias": True}, {"qk_norm": True}])
def test_fused_forward_equals_unfused(over):
    model = _model(**over)
    ref = _logits(model)
    fused = model.fuse_projections()
    attn = fused.layer(0).self_attn
    assert attn.fused is not None and fused.layer(0).mlp.fused is not None
    # the parameters are views of the fused weight: nothing is held twice
    assert attn.q_proj.weight.data_ptr() == attn.fused.weight.data_ptr()
    if over.get("attention_bias"):
        assert attn.k_proj.bias.data_ptr() == attn.fused.bias[attn.q_proj.out_features :].data_ptr()
    torch.testing.assert_close(_logits(fused), ref, rtol=0, atol=1e-12)


def test_in_place_updates_reach_the_fused_weights():
    """How the engine syncs weights: ``copy_`` into the parameters / ``load_state_dict``."""
    model, other = _model(), _model()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ref = _logits(other)
    model.fuse_projections()
    with torch.no_grad():
        for mine, theirs in zip(model.parameters(), other.parameters(), strict=True):
            mine.copy_(theirs)
    torch.testing.assert_close(_logits(model), ref, rtol=0, atol=1e-12)
    model.load_state_dict(_model().state_dict())
    torch.testing.assert_close(_logits(model), _logits(_model()), rtol=0, atol=1e-12)


def test_reassigned_or_copied_parameters_refuse_instead_of_going_stale():
    model = _model().fuse_projections()
    attn = model.layer(1).self_attn
    with torch.no_grad():
        attn.v_proj.weight.data = attn.v_proj.weight.detach().clone() * 3  # breaks the view
    unfused = copy.deepcopy(model)
    for layer in unfused.model.layers.values():
        layer.self_attn.fused = layer.mlp.fused = None
    torch.testing.assert_close(_logits(model), _logits(unfused), rtol=0, atol=1e-12)
    v_rows = attn.fused.weight[-attn.v_proj.out_features :]
    assert v_rows.data_ptr() == attn.v_proj.weight.data_ptr()  # re-fused: a view again
    # a deep copy copies each parameter on its own; its first forward re-fuses
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.layer(0).mlp.up_proj.weight.mul_(2)
        model.layer(0).mlp.up_proj.weight.mul_(2)
    torch.testing.assert_close(_logits(twin), _logits(model), rtol=0, atol=1e-12)


def test_autograd_forwards_train_the_parameters():
    model, ref = _model().fuse_projections(), _model()
    layout = PackedLayout.from_lengths(LENS)
    for m in (model, ref):
        m.train()
        m(_ids(), layout).logits.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-10)


def test_fused_models_and_drafts_still_save(tmp_path):
    model = _model().fuse_projections()
    save_model(model, tmp_path / "m")
    back = load_model(tmp_path / "m", dtype=torch.float64).eval()
    for (k, v), w in zip(back.state_dict().items(), model.state_dict().values(), strict=True):
        torch.testing.assert_close(v, w, rtol=0, atol=0, msg=k)
    _, draft = make_pair()
    ref = draft_state(draft)
    state = draft_state(draft.fuse_projections())
    assert state.keys() == ref.keys()
    for k, v in state.items():
        assert v.untyped_storage().nbytes() == v.numel() * v.element_size(), k
        torch.testing.assert_close(v, ref[k], rtol=0, atol=0)
