"""JSON snapshots of the engine's decision state (bandit, gate, cost model, alarm, n-gram history).

Resuming an RL run must replay speculation decisions exactly: with different drafts the verifier
consumes different random numbers, so even lossless sampling would produce different (equally
distributed) tokens.  These objects are plain Python (numbers, containers, ``random.Random``,
small specrl classes), so a tagged-JSON encoding restores them without pickle: objects are
restored *in place* when they exist, and only the classes named in :data:`RESTORABLE` are ever
encoded or re-created — a checkpoint's JSON cannot make this module import or build anything
else (say ``specrl.rollout.server.FastAPI``, which is FastAPI's class under a specrl name).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import random
from collections import Counter, OrderedDict, deque
from typing import Any

from specrl.errors import CheckpointError

# every class a snapshot may hold (engine decision state and proposer histories); a class not
# listed is refused by snapshot() and restore() alike, so a new one fails its resume test at once
RESTORABLE = frozenset(
    {
        "specrl.rollout.gating.Arm",
        "specrl.rollout.gating.ChainAcceptance",
        "specrl.rollout.gating.CostModel",
        "specrl.rollout.gating.DraftCost",
        "specrl.rollout.gating.EpsilonGreedy",
        "specrl.rollout.gating.LengthModel",
        "specrl.rollout.gating.RunningMean",
        "specrl.rollout.gating.SpecController",
        "specrl.rollout.gating.SpeculationGate",
        "specrl.rollout.metrics.AcceptanceAlarm",
        "specrl.rollout.metrics.Counters",
        "specrl.rollout.metrics.SpecStats",
        "specrl.rollout.metrics._Window",
        "specrl.rollout.proposers.eagle3.TemperatureScale",
        "specrl.rollout.proposers.ngram._TokenIndex",
    }
)


def _path(cls: type) -> str:
    path = f"{cls.__module__}.{cls.__qualname__}"
    if path not in RESTORABLE:
        raise TypeError(f"cannot snapshot {path}: not in specrl.rollout.state.RESTORABLE")
    return path


def snapshot(x: Any) -> Any:
    """Encode ``x`` as JSON-able data with type tags."""
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else {"__float__": repr(x)}
    if isinstance(x, list):
        return [snapshot(v) for v in x]
    if isinstance(x, tuple) and hasattr(x, "_fields") and type(x).__module__.startswith("specrl."):
        path = _path(type(x))  # a specrl NamedTuple (Arm)
        return {"__namedtuple__": path, "values": [snapshot(v) for v in x]}
    if isinstance(x, tuple):
        return {"__tuple__": [snapshot(v) for v in x]}
    if isinstance(x, deque):
        return {"__deque__": [snapshot(v) for v in x], "maxlen": x.maxlen}
    if isinstance(x, (set, frozenset)):
        return {"__set__": sorted((snapshot(v) for v in x), key=repr)}
    if isinstance(x, random.Random):
        version, internal, gauss = x.getstate()
        return {"__random__": [version, list(internal), gauss]}
    if isinstance(x, dict):
        kind = (
            "Counter"
            if isinstance(x, Counter)
            else ("OrderedDict" if isinstance(x, OrderedDict) else "dict")
        )
        return {"__map__": [[snapshot(k), snapshot(v)] for k, v in x.items()], "kind": kind}
    if hasattr(x, "__dict__") and type(x).__module__.startswith("specrl."):
        return {
            "__obj__": _path(type(x)),
            "attrs": {k: snapshot(v) for k, v in vars(x).items()},
        }
    raise TypeError(f"cannot snapshot {type(x).__name__}")


def _class(path: Any) -> type:
    if not isinstance(path, str) or path not in RESTORABLE:
        raise CheckpointError(
            f"engine state names {str(path)[:80]!r}, not a class engine state holds; refusing "
            "to restore it (the checkpoint's JSON was altered or comes from elsewhere)"
        )
    module, _, name = path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    if f"{cls.__module__}.{cls.__qualname__}" != path:  # a re-export, not the class itself
        raise CheckpointError(f"engine state names {path!r}, which is not a class of its own")
    return cls


def _new(path: str) -> Any:
    cls = _class(path)
    return cls.__new__(cls)


def restore(state: Any, into: Any = None) -> Any:
    """Decode ``state``; objects are filled in place when ``into`` is an existing object."""
    if isinstance(state, list):
        return [restore(v) for v in state]
    if not isinstance(state, dict):
        return state
    if "__float__" in state:
        return float(state["__float__"])
    if "__tuple__" in state:
        return tuple(restore(v) for v in state["__tuple__"])
    if "__namedtuple__" in state:
        cls = _class(state["__namedtuple__"])
        if not (isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")):
            raise ValueError(f"{state['__namedtuple__']!r} is not a named tuple")
        return cls(*(restore(v) for v in state["values"]))
    if "__deque__" in state:
        return deque((restore(v) for v in state["__deque__"]), maxlen=state["maxlen"])
    if "__set__" in state:
        return {restore(v) for v in state["__set__"]}
    if "__random__" in state:
        version, internal, gauss = state["__random__"]
        rng = into if isinstance(into, random.Random) else random.Random()
        rng.setstate((version, tuple(internal), gauss))
        return rng
    if "__map__" in state:
        cls = {"Counter": Counter, "OrderedDict": OrderedDict, "dict": dict}[state["kind"]]
        return cls(dict((restore(k), restore(v)) for k, v in state["__map__"]))
    if "__obj__" in state:
        cls = _class(state["__obj__"])
        if issubclass(cls, tuple) and hasattr(cls, "_fields"):  # was a dataclass (older state)
            return cls(**{k: restore(v) for k, v in state["attrs"].items()})
        obj = into if into is not None and hasattr(into, "__dict__") else _new(state["__obj__"])
        frozen = dataclasses.is_dataclass(obj) and type(obj).__dataclass_params__.frozen
        attrs = state["attrs"]
        upgrade = getattr(cls, "upgrade_state", None)  # a class's older snapshots, made current
        if upgrade is not None:
            attrs = upgrade(dict(attrs))
        for name, val in attrs.items():
            current = getattr(obj, name, None)
            keep_obj = (
                current is not None
                and hasattr(current, "__dict__")
                and isinstance(val, dict)
                and "__obj__" in val
            )
            value = restore(
                val, current if keep_obj or isinstance(current, random.Random) else None
            )
            if frozen:
                object.__setattr__(obj, name, value)
            else:
                setattr(obj, name, value)
        return obj
    raise ValueError(f"unknown snapshot tag in {sorted(state)[:3]}")
