"""Argument checks shared by the objectives (trace-time: shapes and options are static)."""

from __future__ import annotations

from typing import Any, Iterable


def check_choice(name: str, value: Any, allowed: Iterable[str]) -> None:
    """Raise ValueError unless `value` is one of `allowed`, naming the argument."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; allowed values: {', '.join(map(repr, allowed))}")


def check_ndim(name: str, x: Any, ndim: int, layout: str) -> None:
    """Raise ValueError unless `x` has `ndim` dimensions (`layout` names them, e.g. '[B, T]')."""
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != ndim:
        raise ValueError(f"{name} must be a {ndim}-D array {layout}; got shape {shape}")


def check_same_shape(name: str, x: Any, ref_name: str, ref: Any) -> None:
    """Raise ValueError unless `x` and `ref` have the same shape."""
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(
            f"{name} has shape {tuple(x.shape)} but {ref_name} has shape {tuple(ref.shape)}; "
            "they must match"
        )


def check_group_size(rewards: Any, group_size: Any, *, minimum: int = 1) -> int:
    """Validate flat `rewards` [B*G] and an int `group_size` >= minimum dividing its length."""
    check_ndim("rewards", rewards, 1, "[B*G] (groups laid out consecutively)")
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ValueError(f"group_size must be a Python int; got {group_size!r}")
    if group_size < minimum:
        raise ValueError(f"group_size must be >= {minimum}; got {group_size}")
    n = rewards.shape[0]
    if n % group_size:
        raise ValueError(
            f"group_size={group_size} does not divide the number of rewards {n}; "
            "rewards must hold whole groups laid out consecutively"
        )
    return n // group_size
