# attrs validators and converters of transform settings, with errors naming the factory and the option.
"""Checks every transform's fields use: ``"<factory>() '<option>' must be ... (got ...)"``."""

from __future__ import annotations

from typing import Any

import attrs

from shardwise.policies import Policy, auto, check_policy

__all__ = ["boolean", "optional_boolean", "integer", "integer_at_least_one", "positive_float",
           "positive_number", "to_policy"]


def _where(instance: Any, attribute: attrs.Attribute[Any]) -> str:
    return f"{type(instance).factory_name}() '{attribute.name}'"


def boolean(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """True or False."""
    if not isinstance(value, bool):
        raise TypeError(f"{_where(instance, attribute)} must be a bool (got {value!r})")


def optional_boolean(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """True, False or None."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{_where(instance, attribute)} must be True, False or None "
                        f"(got {value!r})")


def integer(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """An int (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{_where(instance, attribute)} must be an int (got {value!r})")


def integer_at_least_one(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """An int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{_where(instance, attribute)} must be an integer >= 1 (got {value!r})")


def positive_number(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """An int or float > 0 (NaN refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{_where(instance, attribute)} must be a number > 0 (got {value!r})")


def positive_float(value: Any, factory: str, name: str) -> float:
    """``value`` as a float if it is a number > 0 (checked first, so errors show the input)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{factory}() '{name}' must be a number > 0 (got {value!r})")
    return float(value)


def to_policy(value: Any, factory: str) -> Policy:
    """A policy, ``None`` meaning :func:`shardwise.auto`."""
    if value is None:
        return auto()
    check_policy(value, f"{factory}()")
    return value
