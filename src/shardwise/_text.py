# How a value from outside appears in an error message: short, and never a crash itself.
"""``short(value)``: an excerpt of a value's repr, built without the whole repr."""

from __future__ import annotations

import reprlib

__all__ = ["short"]

# at most 4 items a container, 2 levels, 50 characters a string: a huge or deeply nested
# value (a YAML alias bomb) is never turned into its whole repr
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 2, 50, 50
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4


def short(value: object, limit: int = 80) -> str:
    """An excerpt of ``repr(value)`` of at most ``limit`` characters; a huge int (whose repr
    Python refuses past 4300 digits) is described, and a failing ``__repr__`` names the type."""
    if isinstance(value, int) and value.bit_length() > 256:
        return f"<an int of {value.bit_length()} bits>"
    try:
        text = _REPR.repr(value)
    except Exception:
        return f"<a {type(value).__name__} too large to show>"
    return text if len(text) <= limit else f"{text[:limit - 3]}..."
