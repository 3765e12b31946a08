"""Recipe loading: types, unknown keys, overrides and their precedence, resolved dump."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml

from specrl.config import Recipe, dump_recipe, load_recipe, to_dict
from specrl.config.loader import field_docs
from specrl.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


def test_unknown_key_suggests_closest(tmp_path):
    p = write(tmp_path, "task:\n  max_digit: 4\n")
    with pytest.raises(ConfigError) as exc:
        load_recipe(p, Recipe)
    assert "unknown key 'task.max_digit'" in exc.value.message
    assert str(p) in exc.value.message
    assert exc.value.hint == "did you mean 'task.max_digits'?"


def test_wrong_type_names_field_and_file(tmp_path):
    p = write(tmp_path, "run:\n  seed: abc\n")
    with pytest.raises(ConfigError) as exc:
        load_recipe(p, Recipe)
    assert "'run.seed' must be int" in exc.value.message and str(p) in exc.value.message


def test_bad_literal_and_validation(tmp_path):
    with pytest.raises(ConfigError, match="must be one of"):
        load_recipe(write(tmp_path, "task:\n  name: additoin\n"), Recipe)
    with pytest.raises(ConfigError, match="min_digits"):
        load_recipe(write(tmp_path, "task:\n  min_digits: 5\n  max_digits: 2\n"), Recipe)
    with pytest.raises(ConfigError, match="tail_exponent"):
        load_recipe(write(tmp_path, "task:\n  name: longtail\n  tail_exponent: 0\n"), Recipe)


def test_precedence_cli_over_recipe_over_default(tmp_path):
    p = write(tmp_path, "run:\n  seed: 7\n  name: a\n")
    r = load_recipe(p, Recipe, ["run.name=b"])
    assert r.run.seed == 7  # recipe beats default (0)
    assert r.run.name == "b"  # --set beats recipe
    assert r.task.max_digits == 5  # default
    r = load_recipe(p, Recipe, ["policy.warmstart.steps=12", "policy.warmstart.lr=1e-3"])
    assert r.policy.warmstart.steps == 12 and r.policy.warmstart.lr == 1e-3


def test_override_errors(tmp_path):
    p = write(tmp_path, "")
    with pytest.raises(ConfigError, match=r"key\.path=value"):
        load_recipe(p, Recipe, ["run.seed"])
    with pytest.raises(ConfigError, match=r"unknown key 'run\.sed'"):
        load_recipe(p, Recipe, ["run.sed=3"])


def test_invalid_yaml_names_line(tmp_path):
    with pytest.raises(ConfigError, match="at line 2"):
        load_recipe(write(tmp_path, "run:\n\tseed: 1\n"), Recipe)
    with pytest.raises(ConfigError, match="does not exist"):
        load_recipe(tmp_path / "missing.yaml", Recipe)


def test_resolved_dump_round_trips(tmp_path):
    r = load_recipe(REPO / "recipes/toy/cotrain.yaml", Recipe, ["run.seed=3"])
    dump_recipe(r, tmp_path / "resolved.yaml")
    again = load_recipe(tmp_path / "resolved.yaml", Recipe)
    assert again == r
    assert yaml.safe_load((tmp_path / "resolved.yaml").read_text()) == to_dict(r)


def test_every_field_has_a_docstring():
    docs = field_docs(Recipe)
    assert docs, "schema is empty"
    missing = [k for k, v in docs.items() if not v.strip()]
    assert not missing, f"fields without help: {missing}"


@pytest.mark.parametrize("path", sorted((REPO / "recipes").rglob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_load(path):
    assert isinstance(load_recipe(path, Recipe), Recipe)


def test_optional_sections_are_dataclasses():
    hints = typing.get_type_hints(Recipe)
    for f in dataclasses.fields(Recipe):
        assert dataclasses.is_dataclass(hints[f.name]), f.name
