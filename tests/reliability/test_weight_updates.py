"""Weight updates into a rollout engine are validated completely before anything is replaced
(issue 28 items 6 and 13), and engine state restores only the classes it holds (item 15).

Every refused update must leave every weight, the vocabulary maps and both versions exactly as
they were, and the engine must then decode exactly as before.
"""

from __future__ import annotations

import json

import pytest
import torch

from specrl.errors import CheckpointError
from specrl.models.generate import generate
from specrl.rollout import Request, SpecConfig
from specrl.rollout.weights import check_vocab_map, plan_update
from tests.unit.test_draft import make_pair
from tests.unit.test_engine import greedy, make_engine

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[1, 5, 6, 7, 5, 6], [3, 4, 3, 4, 3]]


def _engine(proposers=("eagle3", "ngram")):
    target, draft = make_pair()
    spec = SpecConfig(
        proposers=proposers, max_k=3, gate=False, proposer_options={"eagle3": {"draft": draft}}
    )
    return target, make_engine(target, max_batch_size=2, spec=spec)


def _draft_state(seed: int = 5) -> dict[str, torch.Tensor]:
    _, other = make_pair(seed=seed)
    return {k: v.clone() for k, v in other.state_dict().items() if not k.startswith("embed")}


def _policy_state(seed: int = 9) -> dict[str, torch.Tensor]:
    other, _ = make_pair(seed=seed)
    return {k: v.clone() for k, v in other.state_dict().items()}


def _frozen(engine) -> dict[str, torch.Tensor]:
    """Every tensor the engine decodes with (policy and draft), cloned, plus the versions."""
    out = {f"policy.{k}": v.clone() for k, v in engine.model.state_dict().items()}
    draft = engine.proposers["eagle3"].draft
    out.update({f"draft.{k}": v.clone() for k, v in draft.state_dict().items()})
    s = engine.stats()
    out["versions"] = torch.tensor([s["policy_version"], s["draft_version"]])
    return out


def _assert_unchanged(engine, before: dict[str, torch.Tensor]) -> None:
    after = _frozen(engine)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed == [], f"a refused update changed {changed[:4]}"


def _outputs(engine):
    return [r.tokens for r in engine.generate([Request(p, greedy(10)) for p in PROMPTS])]


# ----------------------------------------------------------------------- item 6: atomic draft
def test_a_draft_update_refused_on_its_last_tensor_has_replaced_nothing():
    target, engine = _engine()
    before, ref = _frozen(engine), _outputs(engine)
    bad = _draft_state()
    last = list(engine.proposers["eagle3"].draft.state_dict())[-1]  # checked (and copied) last
    bad[last] = bad[last][..., :1].clone()
    with pytest.raises(CheckpointError, match=f"'{last}' has shape"):
        engine.update_weights(draft=bad, version=5)
    _assert_unchanged(engine, before)
    assert _outputs(engine) == ref == generate(target, PROMPTS, 10)


def test_a_policy_and_draft_update_with_a_bad_draft_replaces_neither():
    _, engine = _engine()
    before = _frozen(engine)
    draft = _draft_state()
    draft["fc.weight"][0, 0] = float("nan")
    with pytest.raises(CheckpointError, match=r"draft weight 'fc\.weight' has 1 non-finite"):
        engine.update_weights(policy=_policy_state(), draft=draft, version=3)
    _assert_unchanged(engine, before)


# ----------------------------------------------------------------------- item 13: values, dtypes
@pytest.mark.parametrize("where", ["policy", "draft"])
@pytest.mark.parametrize("bad", ["nan", "inf", "int64", "bool"])
def test_non_finite_or_integer_weights_are_refused(where, bad):
    _, engine = _engine()
    before, ref = _frozen(engine), _outputs(engine)
    state = _policy_state() if where == "policy" else _draft_state()
    name = "model.norm.weight" if where == "policy" else "midlayer.hidden_norm.weight"
    if bad == "nan":
        state[name][-1] = float("nan")
    elif bad == "inf":
        state[name][0] = -float("inf")
    else:
        state[name] = torch.ones_like(state[name], dtype=getattr(torch, bad))
    needle = "non-finite" if bad in ("nan", "inf") else f"dtype {bad}"
    with pytest.raises(CheckpointError, match=f"{where} weight '{name}' has .*{needle}"):
        engine.update_weights(**{where: state})
    _assert_unchanged(engine, before)
    assert _outputs(engine) == ref


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("beyond-vocab", "outside the target vocabulary"),
        ("negative", "outside the target vocabulary"),
        ("duplicate", "same target id"),
        ("t2d-mismatch", "'t2d' does not mark"),
        ("d2t-float", "dtype float64"),
    ],
)
def test_a_draft_vocabulary_map_that_would_index_out_of_range_is_refused(case, needle):
    target, engine = _engine()
    before, ref = _frozen(engine), _outputs(engine)
    state = _draft_state()
    vocab = target.config.vocab_size
    if case == "beyond-vocab":
        state["d2t"][-1] += vocab
    elif case == "negative":
        state["d2t"][0] = -1
    elif case == "duplicate":  # draft id 1 onto draft id 0's target id
        state["d2t"][1] = state["d2t"][0] - 1
    elif case == "t2d-mismatch":
        state["t2d"] = ~state["t2d"]
    else:
        state["d2t"] = state["d2t"].double()
    with pytest.raises(CheckpointError, match=needle):
        engine.update_weights(draft=state)
    _assert_unchanged(engine, before)
    assert _outputs(engine) == ref  # the next eagle3 steps still run (no IndexError)


def test_a_lower_precision_update_is_a_documented_safe_cast():
    _, engine = _engine(proposers=("ngram",))
    other, _ = make_pair(seed=9, dtype=torch.float32)
    engine.update_weights(policy=other.state_dict(), version=2)  # float32 into float64
    for name, value in engine.model.state_dict().items():
        assert value.dtype == torch.float64
        assert torch.equal(value, other.state_dict()[name].double())
    assert engine.stats()["policy_version"] == 2


def test_values_beyond_the_engines_dtype_are_refused():
    own = {"w": torch.zeros(3, dtype=torch.float16), "ids": torch.zeros(2, dtype=torch.int32)}
    ok = {"w": torch.tensor([1.0, -2.0, 65504.0]), "ids": torch.tensor([7, -7])}  # int64 → int32
    assert [v for _, v in plan_update("x", ok, own)] == [ok["w"], ok["ids"]]
    with pytest.raises(CheckpointError, match="beyond the range of the engine's float16"):
        plan_update("x", {**ok, "w": torch.tensor([0.0, 0.0, 1e6])}, own)
    with pytest.raises(CheckpointError, match=r"values in \[0, 4294967296\]"):
        plan_update("x", {**ok, "ids": torch.tensor([0, 2**32])}, own)
    with pytest.raises(CheckpointError, match="1 missing \\('ids'\\), 1 unexpected \\('z'\\)"):
        plan_update("x", {"w": ok["w"], "z": ok["ids"]}, own)
    with pytest.raises(CheckpointError, match="'w' is a list, not a tensor"):
        plan_update("x", {**ok, "w": [1.0, 2.0, 3.0]}, own)


def test_check_vocab_map_accepts_the_maps_specrl_builds():
    _, draft = make_pair()
    check_vocab_map("draft", draft.d2t, draft.t2d, draft.config.vocab_size)
    with pytest.raises(CheckpointError, match="outside"):
        check_vocab_map("draft", draft.d2t, draft.t2d, draft.config.vocab_size - 1)


# ----------------------------------------------------------------------- item 15: engine state
def test_engine_state_is_plain_json_that_names_no_class_and_round_trips():
    """Engine state is numbers, strings and lists written by each class's own ``state_dict``:
    nothing in a checkpoint's JSON is ever imported or constructed."""
    _, engine = _engine()
    _outputs(engine)
    state = json.loads(json.dumps(engine.state_dict()))
    text = json.dumps(state)
    assert "__obj__" not in text and "specrl." not in text
    _, fresh = _engine()
    fresh.load_state_dict(state)
    assert json.loads(json.dumps(fresh.state_dict())) == state


@pytest.mark.parametrize(
    "alter",
    [
        lambda s: s["counters"].__setitem__("steps", {"__obj__": "specrl.rollout.server.FastAPI"}),
        lambda s: s["controller"].pop("gate"),
        lambda s: s["proposers"]["ngram"].__setitem__("history", [["not", "tokens"]]),
        lambda s: s.__setitem__("rng", "seed"),
    ],
    ids=["class-tag", "missing-key", "bad-history", "bad-rng"],
)
def test_altered_engine_state_is_a_one_line_checkpoint_error(alter):
    _, engine = _engine()
    _outputs(engine)
    state = json.loads(json.dumps(engine.state_dict()))
    alter(state)
    with pytest.raises(CheckpointError, match="engine state"):
        engine.load_state_dict(state)


def test_a_legacy_state_naming_a_foreign_class_constructs_nothing():
    _, engine = _engine()
    legacy = {
        "controller": {"__obj__": "specrl.rollout.server.FastAPI", "attrs": {}},
        "_rng": {"__random__": [3, list(range(625)), None]},
        "policy_version": 1,
        "draft_version": 1,
        "_next_seq": 0,
        "_next_request": 0,
    }
    engine.load_state_dict(legacy)  # only the versions, counters and seed are read
    assert engine.stats()["policy_version"] == 1
