"""The recipe's `environment` (a built-in name or 'module:Class') found, checked against the
interface (megarlhf/envs/base.py) and bound to its `env_args`, in the launching process: a
missing class, a method of the wrong shape or arguments the class does not take are one line
each, before any rank starts."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from megarlhf import named

BUILTINS = {
    "tools": "megarlhf.envs.tools:ToolEnvironment",
    "arithmetic_retry": "megarlhf.envs.arithmetic:RetryArithmetic",
}
"""Built-in environments by name: `tools` calls the recipe's `tools` (megarlhf/envs/tools.py);
`arithmetic_retry` lets the model answer an arithmetic question again after a wrong answer."""
_METHODS = {"reset": ("row",), "step": ("response",), "close": ()}


def environment_class(spec: str) -> type:
    """The class `spec` names (a built-in's name, or 'module:Class')."""
    cls = named.load(spec, "environment", BUILTINS, what="Class")
    if not inspect.isclass(cls):
        raise ValueError(f"environment {spec!r} is not a class (it is a "
                         f"{type(cls).__name__}); environments are classes with reset, step "
                         f"and close methods")
    for method, params in _METHODS.items():
        fn = getattr(cls, method, None)
        if not callable(fn):
            raise ValueError(f"environment {spec!r} has no {method}() method; see "
                             f"megarlhf.envs.Environment")
        try:
            inspect.signature(fn).bind(None, *params)
        except TypeError:
            raise ValueError(f"environment {spec!r}: {method}{inspect.signature(fn)} cannot "
                             f"be called as {method}(self{''.join(', ' + p for p in params)})"
                             ) from None
    return cls


def environment_factory(spec: str, env_args: dict[str, Any], **builtin_args
                        ) -> Callable[[], Any]:
    """Makes one environment per episode: the class constructed with `env_args` (and, for a
    built-in, those of the run's objects in `builtin_args` it takes, e.g. the tools)."""
    cls = environment_class(spec)
    takes = inspect.signature(cls).parameters if spec in BUILTINS else {}
    args = {**{k: v for k, v in builtin_args.items() if k in takes}, **env_args}
    try:
        inspect.signature(cls).bind(**args)
    except TypeError as e:
        raise ValueError(f"env_args {sorted(env_args)} do not fit environment {spec!r}"
                         f"{inspect.signature(cls)}: {e}") from None
    return functools.partial(cls, **args)
