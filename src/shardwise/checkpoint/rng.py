# Capture and restore this process's random number generators as JSON (no pickling).
"""RNG state as JSON: torch CPU and CUDA, Python ``random``, NumPy when installed."""

from __future__ import annotations

import base64
import random
from typing import Any

import torch

__all__ = ["capture", "restore", "check"]


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def capture() -> dict[str, Any]:
    """This process's generator states."""
    version, internal, gauss = random.getstate()
    out: dict[str, Any] = {"torch": _encode(torch.get_rng_state()),
                           "python": [version, list(internal), gauss]}
    if torch.cuda.is_available():
        out["cuda"] = [_encode(s) for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np
    except ImportError:
        return out
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out["numpy"] = [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    return out


def restore(state: dict[str, Any]) -> None:
    """Set the generators to a state from :func:`capture`."""
    torch.set_rng_state(_decode(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_decode(s) for s in state["cuda"]])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def check(state: Any) -> None:
    """Raise ValueError unless :func:`restore` accepts ``state``; changes nothing."""
    saved = capture()
    try:
        restore(state)
    except Exception as exc:
        raise ValueError(f"not RNG states written by shardwise ({type(exc).__name__}: "
                         f"{str(exc)[:80]})") from None
    finally:
        restore(saved)
