"""Typed recipes: dataclass schemas, YAML loading, ``--set`` overrides. No torch here.

Precedence, stated once: **command-line ``--set`` overrides > recipe YAML > dataclass defaults.**
"""

from specrl.config.loader import (
    apply_overrides,
    dump_recipe,
    from_dict,
    load_recipe,
    parse_override,
    to_dict,
)
from specrl.config.schema import Recipe

__all__ = [
    "Recipe",
    "apply_overrides",
    "dump_recipe",
    "from_dict",
    "load_recipe",
    "parse_override",
    "to_dict",
]
