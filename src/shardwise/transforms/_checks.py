# attrs validators and converters of transform settings, with errors naming the factory and the option.
"""Checks every transform's fields use: ``"<factory>() '<option>' must be ... (got ...)"``."""

from __future__ import annotations

import math
from typing import Any

import attrs

from shardwise._text import short as _short
from shardwise.errors import ArgumentError
from shardwise.policies import Policy, auto, check_policy

__all__ = ["boolean", "optional_boolean", "integer", "integer_at_least_one", "positive_float",
           "positive_number", "to_policy", "group_size", "MAX_COUNT", "MAX_MIB", "MAX_GROUP"]


def _where(instance: Any, attribute: attrs.Attribute[Any]) -> str:
    return f"{type(instance).factory_name}() '{attribute.name}'"


def boolean(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """True or False."""
    if not isinstance(value, bool):
        raise ArgumentError(f"{_where(instance, attribute)} must be a bool (got {_short(value)})")


def optional_boolean(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """True, False or None."""
    if value is not None and not isinstance(value, bool):
        raise ArgumentError(f"{_where(instance, attribute)} must be True, False or None "
                            f"(got {_short(value)})")


def integer(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """An int (not a bool) that fits in 64 bits, as a torch generator's seed must."""
    if isinstance(value, bool) or not isinstance(value, int) or not -2**63 <= value < 2**63:
        raise ArgumentError(f"{_where(instance, attribute)} must be an integer in "
                            f"[-2**63, 2**63) (got {_short(value)})")


#: The largest count a transform takes (a window of micro-batches, ...): a C int.
MAX_COUNT = 2**31 - 1


def integer_at_least_one(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """An int in [1, 2**31 - 1]."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
        raise ArgumentError(f"{_where(instance, attribute)} must be an integer in "
                            f"[1, {MAX_COUNT}] (got {_short(value)})")


#: The most ranks a parallel group spans (``tensor_parallel``'s, ``context_parallel``'s, ...).
MAX_GROUP = 2**16


def group_size(none_means: str) -> Any:
    """A validator of a group's ``size``: None (``none_means``: the size worked out) or an
    int in [1, 65536]."""
    def check(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 1 <= value <= MAX_GROUP):
            raise ArgumentError(f"{_where(instance, attribute)} must be None ({none_means}) "
                                f"or an integer in [1, {MAX_GROUP}] (got {_short(value)})")
    return check


#: The largest size in MiB a transform takes (DDP's bucket size): 1 TiB.
MAX_MIB = 2**20


def positive_number(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """A finite number in (0, 2**20] (a size in MiB; NaN and inf refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not 0 < value <= MAX_MIB:
        raise ArgumentError(f"{_where(instance, attribute)} must be a number in (0, {MAX_MIB}] "
                            f"(got {_short(value)})")


def positive_float(value: Any, factory: str, name: str, *, infinite: bool = False) -> float:
    """``value`` as a float if it is a number > 0, finite unless ``infinite`` (checked before
    converting, so errors show the input)."""
    number = isinstance(value, float) or (isinstance(value, int) and value.bit_length() < 1024)
    finite = number and (infinite or math.isfinite(value))
    if isinstance(value, bool) or not finite or not value > 0:
        accepted = "a number > 0 or math.inf" if infinite else "a finite number > 0"
        raise ArgumentError(f"{factory}() '{name}' must be {accepted} (got {_short(value)})")
    return float(value)


def to_policy(value: Any, factory: str) -> Policy:
    """A policy, ``None`` meaning :func:`shardwise.auto`."""
    if value is None:
        return auto()
    check_policy(value, f"{factory}()")
    return value
