"""Typed command-line overrides for nested frozen dataclass configs.

`apply_overrides(cfg, ["optim.lr=1e-5", "run.dir=/tmp/x"])` returns a new config with those
fields replaced. Each value is parsed by the field's annotated type (int, float, bool, str,
`Optional[...]`, `X | None`, `Literal[...]`, tuples, unions of those), so `--set
optim.lr=fast` fails before anything runs, with an error that names the key, the expected
type and the text given. Unknown keys fail with the list of valid keys at that level.

All overrides aimed at one dataclass are applied with a single `dataclasses.replace`, so its
`__post_init__` validation sees the final combination (setting two fields that must agree
never trips over an intermediate state).

`none` (or `null`) means None in every field that admits None (`str | None` included; in
a plain `str` field it is the word "none", e.g. `model.remat=none`), except in a *preset
field*: a field of a dataclass that lists it in its class attribute `PRESET_FIELDS`
(``AlgorithmConfig``), where None means "the preset of `name`". There `X=none` sets the value "none" where that is a legal value
(`algorithm.kl_in=none` turns the KL term off) and is an error where it is not, and
`X=preset` returns the field to its preset. A value in matching quotes (`X="none"`,
`X='3'`) is taken as that string where the field accepts strings, else parsed without
its quotes.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from typing import Any

from rljax.train.config.dicts import dataclass_in, is_union

__all__ = ["OverrideError", "PRESET_WORD", "apply_overrides", "parse_value", "parse_override"]

_NONE_WORDS = ("none", "null")
#: The override value that returns a preset field to the preset of its config's `name`.
PRESET_WORD = "preset"
_TRUE_WORDS = ("true", "1", "yes", "on")
_FALSE_WORDS = ("false", "0", "no", "off")


class OverrideError(ValueError):
    """A `key=value` override that names no field or whose value does not parse."""


def parse_override(text: str) -> tuple[tuple[str, ...], str]:
    """Split `"a.b.c=value"` into `(("a", "b", "c"), "value")` (the value may contain `=`)."""
    if not isinstance(text, str) or "=" not in text:
        raise OverrideError(f"override {text!r} must have the form key.path=value")
    key, value = text.split("=", 1)
    parts = tuple(p.strip() for p in key.strip().split("."))
    if not parts or any(not p for p in parts):
        raise OverrideError(f"override {text!r} has an empty key part; use e.g. optim.lr=1e-5")
    return parts, value.strip()


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _split_tuple_text(text: str) -> list[str]:
    inner = text.strip()
    if inner[:1] in "([" and inner[-1:] in ")]":
        inner = inner[1:-1]
    return [p.strip() for p in inner.split(",") if p.strip()]


def _parse_scalar(tp: Any, text: str) -> Any:
    if tp is bool:
        low = text.lower()
        if low in _TRUE_WORDS:
            return True
        if low in _FALSE_WORDS:
            return False
        raise ValueError("not a bool (true/false)")
    if tp is int:
        return int(text)
    if tp is float:
        return float(text)
    if tp is str:
        return text
    if tp is type(None):
        if text.lower() in _NONE_WORDS:
            return None
        raise ValueError("not None")
    if tp is Any or tp is object:
        return _parse_any(text)
    raise TypeError(f"fields of type {_type_name(tp)} cannot be set from text")


def _parse_any(text: str) -> Any:
    """Best-effort parse for untyped fields: None, bool, int, float, else the string."""
    low = text.lower()
    if low in _NONE_WORDS:
        return None
    if low in ("true", "false"):
        return low == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def _unquote(text: str) -> str | None:
    """The text inside matching single or double quotes, or None when not quoted."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return None


def _admits_str(tp: Any) -> bool:
    if tp is str or tp is Any or tp is object:
        return True
    return is_union(tp) and any(_admits_str(a) for a in typing.get_args(tp))


def parse_value(tp: Any, text: str) -> Any:
    """Parse `text` as a value of annotated type `tp` (quoted text: the module docstring);
    raise ValueError/TypeError if it is not one."""
    inner = _unquote(text)
    if inner is not None and typing.get_origin(tp) is not tuple and tp is not tuple:
        if _admits_str(tp):
            return inner
        text = inner
    origin = typing.get_origin(tp)
    if is_union(tp):
        args = typing.get_args(tp)
        # None first so "none" means None even in Optional[str].
        ordered = sorted(args, key=lambda a: a is not type(None))
        for arg in ordered:
            try:
                return parse_value(arg, text)
            except (ValueError, TypeError):
                continue
        raise ValueError(f"matches none of {_type_name(tp)}")
    if origin is typing.Literal:
        for choice in typing.get_args(tp):
            try:
                if parse_value(type(choice), text) == choice:
                    return choice
            except (ValueError, TypeError):
                continue
        raise ValueError(f"not one of {list(typing.get_args(tp))}")
    if origin is tuple or tp is tuple:
        args = typing.get_args(tp)
        items = _split_tuple_text(text)
        if not args:
            return tuple(_parse_any(i) for i in items)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(parse_value(args[0], i) for i in items)
        if len(items) != len(args):
            raise ValueError(f"needs {len(args)} comma-separated items, got {len(items)}")
        return tuple(parse_value(a, i) for a, i in zip(args, items))
    if dataclasses.is_dataclass(tp):
        raise TypeError(f"{_type_name(tp)} is a config section; set its fields (key.field=value)")
    return _parse_scalar(tp, text)


def _field_types(obj: Any) -> dict[str, Any]:
    cls = type(obj)
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # unresolvable forward references: use what the fields say
        hints = {}
    out = {}
    for f in dataclasses.fields(obj):
        tp = hints.get(f.name, f.type)
        out[f.name] = Any if isinstance(tp, str) else tp
    return out


def _section_value(obj: Any, name: str, tp: Any, where: str) -> Any:
    """The dataclass to descend into for `name`; builds a default one when it is None."""
    current = getattr(obj, name)
    if dataclasses.is_dataclass(current) and not isinstance(current, type):
        return current
    cls = dataclass_in(tp)
    if current is None and cls is not None:
        try:
            return cls()
        except TypeError as e:
            raise OverrideError(
                f"{where} is None and {cls.__name__} has required fields ({e}); "
                f"it cannot be created from overrides"
            ) from None
    raise OverrideError(f"{where} is a {_type_name(type(current))} value, not a config section")


def _apply_tree(obj: Any, tree: dict[str, Any], prefix: str) -> Any:
    types_by_name = _field_types(obj)
    changes = {}
    for name, sub in tree.items():
        where = f"{prefix}{name}"
        if name not in types_by_name:
            level = prefix[:-1] or "the top level"
            raise OverrideError(
                f"unknown key {where!r}: valid keys at {level} are {sorted(types_by_name)}"
            )
        tp = types_by_name[name]
        if isinstance(sub, dict):
            section = _section_value(obj, name, tp, where)
            changes[name] = _apply_tree(section, sub, where + ".")
            continue
        if name in _preset_fields(obj):
            changes[name] = _parse_preset_field(tp, sub, where)
            continue
        try:
            changes[name] = parse_value(tp, sub)
        except (ValueError, TypeError) as e:
            raise OverrideError(
                f"cannot set {where}: expected {_type_name(tp)}, got {sub!r} ({e})"
            ) from None
    try:
        return dataclasses.replace(obj, **changes)
    except (ValueError, TypeError) as e:
        keys = ", ".join(f"{prefix}{k}" for k in changes)
        presets = [f"{prefix}{k}" for k in changes if k in _preset_fields(obj)]
        hint = (f"; {presets[0]}={PRESET_WORD} returns a field to the preset of "
                f"{prefix}name" if presets else "")
        raise OverrideError(f"overrides of {keys} give an invalid config: {e}{hint}") from e


def _preset_fields(obj: Any) -> frozenset[str]:
    """The fields of `obj` whose None means "the preset" (its class's `PRESET_FIELDS`)."""
    return frozenset(getattr(type(obj), "PRESET_FIELDS", ()))


def _parse_preset_field(tp: Any, text: str, where: str) -> Any:
    """A preset field's value: `preset` -> None (the preset), `none` -> the string
    "none" where the field takes strings (its config's validation decides whether "none"
    is legal), else the value parsed as the field's type without None."""
    if text.lower() == PRESET_WORD:
        return None
    args = typing.get_args(tp) if is_union(tp) else (tp,)
    value_tp = typing.Union[tuple(a for a in args if a is not type(None))]  # noqa: UP007
    section = where.rsplit(".", 1)[0] + "." if "." in where else ""
    allowed = (f"{_type_name(value_tp)}, or {PRESET_WORD!r} for the preset of "
               f"{section}name")
    word = _unquote(text) or text
    if word.lower() in _NONE_WORDS:
        if _admits_str(value_tp):
            return "none"
        raise OverrideError(f"cannot set {where}: 'none' is not one of its values (expected "
                            f"{allowed}); {where}={PRESET_WORD} returns it to the preset")
    try:
        return parse_value(value_tp, text)
    except (ValueError, TypeError) as e:
        raise OverrideError(f"cannot set {where}: expected {allowed}, got {text!r} ({e})") \
            from None


def apply_overrides(cfg: Any, overrides: Sequence[str]) -> Any:
    """Return `cfg` (a frozen dataclass) with each `"a.b=value"` override applied (see the
    module docstring; an empty list returns `cfg` unchanged). Raises `OverrideError` (a
    ValueError) for the errors the module docstring names and for a key given twice."""
    if not (dataclasses.is_dataclass(cfg) and not isinstance(cfg, type)):
        raise TypeError(f"cfg must be a dataclass instance, got {type(cfg).__name__}")
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'key=value' strings, not one string")
    tree: dict[str, Any] = {}
    for text in overrides:
        parts, value = parse_override(text)
        node = tree
        for depth, part in enumerate(parts[:-1]):
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise OverrideError(f"{'.'.join(parts[: depth + 1])} is set as a value and a section")
            node = nxt
        if parts[-1] in node:
            raise OverrideError(f"{'.'.join(parts)} is overridden twice")
        node[parts[-1]] = value
    if not tree:
        return cfg
    return _apply_tree(cfg, tree, "")
