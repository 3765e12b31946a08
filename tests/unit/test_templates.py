"""Recipe templates for GPU clusters: valid schema and layout arithmetic, checked on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from specrl.config import Recipe, load_recipe
from specrl.errors import LayoutError
from specrl.models.presets import preset_config
from specrl.train.layout import check_layout, check_model

TEMPLATES = sorted((Path(__file__).resolve().parents[2] / "recipes/templates").glob("*.yaml"))


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.stem)
def test_template_schema_and_layout(path):
    r = load_recipe(path, Recipe)
    assert r.run.device == "cuda" and r.policy.shape, "templates target GPUs and name a shape"
    p = r.parallel
    dims = check_layout(p, p.dp * p.cp * p.pp)  # the world the template is launched with
    cfg = preset_config(r.policy.shape)
    check_model(dims, cfg)
    assert r.rollout.prompts_per_step % p.dp == 0
    if p.pp > 1:
        assert p.microbatches >= p.pp, "fewer microbatches than stages starves the pipeline"
    if r.draft.init is not None and r.draft.init.draft_vocab:
        assert r.draft.init.draft_vocab <= cfg.vocab_size
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0


def test_templates_exist():
    assert len(TEMPLATES) >= 3


def test_layout_check_catches_a_bad_template(tmp_path):
    r = load_recipe(TEMPLATES[0], Recipe, ["parallel.pp=40", "parallel.dp=1"])
    p = r.parallel
    dims = check_layout(p, p.dp * p.cp * p.pp)
    with pytest.raises(LayoutError):
        check_model(dims, preset_config("llama-8b"))  # 32 layers cannot fill 40 stages
    with pytest.raises(LayoutError):
        check_layout(p, 8)  # launched with the wrong number of processes
