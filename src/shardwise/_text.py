# How a value from outside appears in an error message: short, and never a crash itself.
"""``short(value)``: at most 80 characters of a value's repr."""

from __future__ import annotations

__all__ = ["short"]


def short(value: object, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters; a huge int (whose repr Python refuses
    past 4300 digits) is described instead, and a failing ``__repr__`` names the type."""
    if isinstance(value, int) and value.bit_length() > 256:
        return f"<an int of {value.bit_length()} bits>"
    try:
        text = repr(value)
    except Exception:
        return f"<a {type(value).__name__}>"
    return text if len(text) <= limit else f"{text[:limit - 3]}..."
