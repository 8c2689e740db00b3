"""Frozen config dataclasses to strict-JSON nested dicts and back.

`config_to_dict` writes what `config.json` and `reward_model.json` hold; `config_from_dict`
rebuilds the dataclass from it using the field annotations (nested sections, optional
sections, tuples, non-finite floats written as text). Both the trainer core (saved reward
models) and the run layer (run directories) use them, so they live here, below the run layer.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

__all__ = ["config_from_dict", "config_to_dict", "dataclass_in", "is_union", "jsonable"]


def is_union(tp: Any) -> bool:
    """True for `A | B` and `typing.Union[A, B]` (also `Optional`)."""
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def dataclass_in(tp: Any) -> type | None:
    """The single dataclass type inside `tp` (e.g. `SFTConfig | None`), else None."""
    cands = typing.get_args(tp) if is_union(tp) else (tp,)
    found = [c for c in cands if isinstance(c, type) and dataclasses.is_dataclass(c)]
    return found[0] if len(found) == 1 else None


def jsonable(x: Any) -> Any:
    """`x` (dataclasses, dicts, sequences, numpy / jax scalars) as strict-JSON-able values."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: jsonable(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # "inf", "-inf", "nan": strict JSON has no such numbers
    if x is None or isinstance(x, (str, int, float, bool)):
        return x
    if hasattr(x, "item") and getattr(x, "ndim", None) == 0:  # numpy / jax scalars
        return jsonable(x.item())
    return repr(x)


def config_to_dict(config: Any) -> dict[str, Any]:
    """The config (a dataclass, or a dict) as strict-JSON-able nested dicts."""
    if not (isinstance(config, dict) or dataclasses.is_dataclass(config)):
        raise TypeError(f"config must be a dataclass instance or dict, got {type(config).__name__}")
    return jsonable(config)


def _from_json(tp, value):
    """Rebuild a value of annotated type `tp` from its `config_to_dict` JSON form."""
    if value is None:
        return None
    cls = dataclass_in(tp)
    if cls is not None and isinstance(value, dict):
        return config_from_dict(cls, value)
    if isinstance(value, list):
        cands = typing.get_args(tp) if is_union(tp) else (tp,)  # `tuple[...] | None` or one
        tuples = [a for a in cands if typing.get_origin(a) is tuple]
        args = typing.get_args(tuples[0]) if tuples else ()
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_from_json(args[0], v) for v in value)
        if len(args) == len(value):
            return tuple(_from_json(a, v) for a, v in zip(args, value))
        return tuple(value)
    if isinstance(value, str) and value in ("inf", "-inf", "nan"):
        return float(value)  # config_to_dict writes non-finite floats as text
    return value


def config_from_dict(cls: type, d: dict[str, Any]) -> Any:
    """Rebuild dataclass `cls` from the nested dicts of `config_to_dict` (config.json)."""
    if not isinstance(d, dict):
        raise TypeError(f"{cls.__name__}: expected a dict, got {type(d).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown keys {unknown}; valid: {sorted(names)}")
    return cls(**{k: _from_json(hints[k], v) for k, v in d.items()})
