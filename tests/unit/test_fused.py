"""The fused inference path (q|k|v and gate|up as one projection each) and its weight copies."""

from __future__ import annotations

import copy

import pytest
import torch

from specrl.core.attention import PackedLayout
from specrl.models import fused
from specrl.models.decoder import CacheBatch, Transformer
from specrl.models.draft import DraftConfig, Eagle3Draft, init_draft_weights
from specrl.models.fused import inference_copy, invalidate, project
from specrl.models.presets import preset_config

VOCAB = 61


def _model(**over) -> Transformer:
    cfg = preset_config("toy-tiny", vocab_size=VOCAB, **over)
    return Transformer(cfg).init_weights(3, std=0.2).double().eval()


VARIANTS = {
    "llama": {},
    "bias-tied": {"attention_bias": True, "tie_word_embeddings": True},
    "qk-norm-mha": {"qk_norm": True, "num_key_value_heads": 4},
    "window": {"sliding_window": 3},
}


def _cached_run(model: Transformer, fused: bool) -> list[torch.Tensor]:
    """Prefill then uneven chunks (as speculative verification feeds), slots out of order."""
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (9, 14, 4)]
    cache = model.new_cache(num_slots=5, max_len=20)
    slots = torch.tensor([4, 0, 2])
    done, outs = [0, 0, 0], []
    for chunk in ([3, 5, 1], [1, 1, 1], [4, 2, 2], [1, 6, 0]):
        active = [i for i in range(3) if chunk[i] > 0]
        ids = torch.cat([seqs[i][done[i] : done[i] + chunk[i]] for i in active])
        cb = CacheBatch(
            cache,
            slots[active],
            torch.tensor([done[i] for i in active]),
            max(done[i] + chunk[i] for i in active),
        )
        layout = PackedLayout.from_lengths([chunk[i] for i in active])
        out = model(ids, layout, cache=cb, taps=[0], fused=fused)
        outs += [out.logits, out.taps[0]]
        for i in active:
            done[i] += chunk[i]
    return outs


@pytest.mark.parametrize("layout", ["transposed", "rows"])
@pytest.mark.parametrize("over", list(VARIANTS.values()), ids=list(VARIANTS))
def test_fused_forward_equals_module_forward_fp64(over, layout):
    model = _model(**over)
    fused.set_cpu_layout(model, layout)
    lens = [1, 7, 3, 12]
    ids = torch.randint(0, VOCAB, (sum(lens),), generator=torch.Generator().manual_seed(1))
    layout = PackedLayout.from_lengths(lens)
    with torch.no_grad():
        ref = model(ids, layout, taps=[0, 1])
        got = model(ids, layout, taps=[0, 1], fused=True)
        torch.testing.assert_close(got.logits, ref.logits, rtol=0, atol=1e-12)
        for layer in (0, 1):
            torch.testing.assert_close(got.taps[layer], ref.taps[layer], rtol=0, atol=1e-12)
        for a, b in zip(_cached_run(model, True), _cached_run(model, False), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_project_layouts_and_terms():
    """Every combination of bias and residual, on both copy layouts, equals the module math."""
    gen = torch.Generator().manual_seed(4)
    a, b = (torch.randn(n, 6, generator=gen, dtype=torch.float64) for n in (5, 3))
    bias, x, res = (torch.randn(s, generator=gen, dtype=torch.float64) for s in (8, (4, 6), (4, 8)))
    ref = x @ torch.cat([a, b]).T
    for transposed in (True, False):
        w = inference_copy([a, b], transposed)
        assert w.shape == ((6, 8) if transposed else (8, 6))
        assert w.is_contiguous()
        for bias_, res_ in ((None, None), (bias, None), (None, res), (bias, res)):
            want = ref + (0 if bias_ is None else bias_) + (0 if res_ is None else res_)
            got = project(x, w, bias_, res_, transposed)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_fused_forward_needs_no_grad():
    model = _model()
    with pytest.raises(RuntimeError, match="no_grad"):
        model(torch.tensor([1, 2]), PackedLayout.from_lengths([2]), fused=True)


def _logits(model: Transformer, fused: bool) -> torch.Tensor:
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    with torch.no_grad():
        return model(ids, PackedLayout.from_lengths([8]), fused=fused).logits


def _assert_fresh(model: Transformer) -> None:
    torch.testing.assert_close(_logits(model, True), _logits(model, False), rtol=0, atol=1e-12)


def test_fused_copies_follow_every_in_place_weight_change():
    model = _model(attention_bias=True)
    before = _logits(model, True)
    layer = model.layer(0)
    with torch.no_grad():  # in-place op on one projection of each fused group
        layer.self_attn.k_proj.weight.mul_(1.5)
        layer.mlp.up_proj.weight.add_(0.1)
    assert not torch.allclose(_logits(model, True), before)
    _assert_fresh(model)

    with torch.no_grad():  # a bias alone
        model.layer(1).self_attn.v_proj.bias.add_(0.3)
    _assert_fresh(model)

    other = _model(attention_bias=True)  # load_state_dict copies in place
    other.init_weights(11, std=0.2)
    model.load_state_dict(other.double().state_dict())
    _assert_fresh(model)

    opt = torch.optim.AdamW(model.parameters(), lr=0.05)  # an optimizer step
    loss = model(torch.tensor([1, 2, 3]), PackedLayout.from_lengths([3])).logits.square().mean()
    loss.backward()
    opt.step()
    _assert_fresh(model)

    fresh = copy.deepcopy(model)  # a copy rebuilds its own fused weights
    with torch.no_grad():
        fresh.layer(0).self_attn.q_proj.weight.zero_()
    _assert_fresh(fresh)
    _assert_fresh(model)


def test_fused_plan_follows_replaced_modules_parameters_and_layout():
    """A replaced weight or module (no version counter moves) and a layout switch rebuild the
    decoder's plan; a forward with nothing changed reuses it."""
    model = _model()
    _assert_fresh(model)
    plan = model._plan
    copies = plan.get(model)
    assert plan.get(model) is copies  # nothing changed: no rebuild
    other = _model()
    other.init_weights(5, std=0.2)
    model.load_state_dict(other.double().state_dict(), assign=True)  # new Parameter objects
    _assert_fresh(model)
    model.layer(1).mlp.down_proj = torch.nn.Linear(128, 64, bias=False).double()  # module surgery
    _assert_fresh(model)
    model.layer(0).self_attn.q_proj.weight = torch.nn.Parameter(
        torch.randn_like(model.layer(0).self_attn.q_proj.weight)
    )
    _assert_fresh(model)
    built = plan.get(model)
    for layout in ("rows", "transposed"):
        fused.set_cpu_layout(model, layout)
        assert plan.get(model).layers[0].transposed == (layout == "transposed")
        _assert_fresh(model)
    assert plan.get(model) is not built


def test_writes_through_data_need_invalidate():
    """``.data`` bypasses version counters (documented contract): stale until invalidated."""
    model = _model()
    _logits(model, True)  # builds the fused copies
    w = model.layer(0).mlp.gate_proj.weight
    w.data = w.data * 2.0  # new storage, same parameter object
    _assert_fresh(model)  # a new storage is seen
    w.data.mul_(0.5)  # in-place through .data: the counter does not move
    assert not torch.allclose(_logits(model, True), _logits(model, False))
    invalidate(model)
    _assert_fresh(model)


def _draft_run(draft: Eagle3Draft, fused: bool) -> list[torch.Tensor]:
    """Main entries of three sequences (uneven, slots out of order), then two chain steps of
    one token each, as the eagle3 proposer decodes: pre-norm h and logits of every pass."""
    gen = torch.Generator().manual_seed(5)
    h_dim, vocab = draft.config.hidden_size, draft.config.vocab_size
    cache = draft.new_cache(num_slots=4, max_len=16)
    slots = torch.tensor([3, 0, 1])
    outs: list[torch.Tensor] = []
    prefix = [0, 0, 0]
    for lens in ([4, 6, 2], [1, 1, 1], [1, 1, 1]):
        feat = torch.randn(sum(lens), h_dim, generator=gen, dtype=torch.float64)
        ids = torch.randint(0, vocab, (sum(lens),), generator=gen)
        cb = CacheBatch(
            cache,
            slots,
            torch.tensor(prefix),
            max(p + n for p, n in zip(prefix, lens, strict=True)),
        )
        h = draft.decode(feat, ids, PackedLayout.from_lengths(lens), cb, fused=fused)
        outs += [h, draft.logits(h, fused=fused)]
        prefix = [p + n for p, n in zip(prefix, lens, strict=True)]
    return outs


@pytest.mark.parametrize("layout", ["transposed", "rows"])
def test_draft_decoding_path_equals_the_module_path_fp64(layout):
    """The draft's decoding copies (DraftPlan) compute the module math, and follow in-place
    weight changes and a replaced (re-shared) embedding."""
    tcfg = preset_config("toy-tiny", vocab_size=VOCAB)
    cfg = DraftConfig.for_target(tcfg, draft_vocab_size=40, tap_layers=(0, 0, 1))
    draft = init_draft_weights(Eagle3Draft(cfg).double(), seed=2, std=0.2)
    fused.set_cpu_layout(draft, layout)
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(torch.randn(VOCAB, cfg.hidden_size, dtype=torch.float64))

    def check() -> None:
        with torch.no_grad():
            got, ref = _draft_run(draft, True), _draft_run(draft, False)
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)

    check()
    with torch.no_grad():
        draft.midlayer.mlp.up_proj.weight.mul_(1.5)
        draft.lm_head.weight.add_(0.1)
        draft.midlayer.hidden_norm.weight.mul_(0.5)
    check()
    h = torch.zeros(2, cfg.hidden_size, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="no_grad"):  # the copies are detached
        draft.logits(h, fused=True)
    target = _model()
    draft.refresh_embedding(target.model.embed_tokens.weight.detach(), share=True)
    check()
    with torch.no_grad():  # the shared embedding moves with the target's in-place updates
        target.model.embed_tokens.weight.mul_(2.0)
    check()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rope_tables_equal_the_computed_rows_bit_for_bit(dtype):
    """``cos_sin`` with a position bound looks its rows up in tables (grown on demand) that hold
    exactly the computed values; without a bound it computes them."""
    rotary = _model().rotary
    gen = torch.Generator().manual_seed(8)
    for bound in (5, 40, 255, 300, 1000):  # 300 and 1000 grow the first 256-row table
        pos = torch.randint(0, bound + 1, (17,), generator=gen)
        pos[0] = bound
        got = rotary.cos_sin(pos, dtype, bound)
        want = rotary.cos_sin(pos, dtype)
        for a, b in zip(got, want, strict=True):
            assert a.shape == (17, 1, rotary_dim(rotary)) and a.dtype == dtype
            assert torch.equal(a, b)
    assert rotary._tables[(torch.device("cpu"), dtype)][0].shape[0] > 1000


def rotary_dim(rotary) -> int:
    return 2 * len(rotary.inv_freq_list)
