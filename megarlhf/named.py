"""What a recipe names by 'module:attribute' (reward functions, environments, tool parsers,
tools) or by a built-in's bare name, found in one way. No torch here: the reward and tool
worker processes import it."""

from __future__ import annotations

import importlib
from typing import Any


def load(spec: str, field: str, builtins: dict[str, Any], *, what: str = "function") -> Any:
    """The object `spec` names: a built-in's (`builtins[spec]`, itself a 'module:name' text
    when the built-in is imported only when used), or a module's attribute ('module:name');
    ValueError naming `field` when there is none."""
    if spec in builtins:
        value = builtins[spec]
        return load(value, field, {}, what=what) if isinstance(value, str) else value
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        listed = f"a built-in ({', '.join(builtins)}) or " if builtins else ""
        raise ValueError(f"{field} {spec!r} must be {listed}'module:{what}'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{field} {spec!r} cannot be loaded: {type(e).__name__}: {e}"
                         ) from None
