"""Recipes and `key=value` overrides -> frozen config dataclasses, strictly: the one loader
of every command (SFT, RM, PPO, plan).

A recipe is a YAML file or a 'module:function' that returns the config (or a mapping of its
fields). Overrides are applied on top with dotted keys for nested fields (`train.steps=100`)
and values parsed as YAML. Every key must name a field (an unknown or misspelt key is an error
that lists the valid ones; a retired one, in the class's RETIRED, an error that names what
replaced it), every value must have the field's type, and each dataclass
validates itself on construction, so a config is checked once, before any process group or
model exists.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import os
import types
import typing
from typing import Any, TypeVar

import yaml

C = TypeVar("C")


def from_dict(cls: type[C], data: Any, where: str = "config") -> C:
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping of {cls.__name__} fields, got "
                         f"{type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    retired = sorted(set(data) & set(getattr(cls, "RETIRED", {})))
    if retired:
        raise ValueError(f"{where}: " + "; ".join(f"{name} is retired: {cls.RETIRED[name]}"
                                                  for name in retired))
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {where}; valid keys: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    missing = sorted(name for name, f in fields.items() if name not in data
                     and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    if missing:
        raise ValueError(f"{where} is missing required key(s) {missing}")
    kwargs = {k: convert(hints[k], v, f"{where}.{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def convert(tp, value, where: str):
    """`value` as type `tp` (a field's annotation), or ValueError naming `where`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return convert(option, value, where)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if len(errors) == 1 else f"{where}: {value!r} fits none of "
                         f"{[getattr(o, '__name__', str(o)) for o in options]}")
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if origin is tuple:  # tuple[X, ...]: YAML gives a list
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where} must be a list, got {value!r}")
        item = typing.get_args(tp)[0]
        return tuple(convert(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be a mapping, got {value!r}")
        args = typing.get_args(tp)
        if args:
            return {convert(args[0], k, f"{where} key"): convert(args[1], v, f"{where}.{k}")
                    for k, v in value.items()}
        return dict(value)
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads 1e-3 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        hint = (" (YAML reads yes/no/on/off unquoted as booleans: quote the word)"
                if tp is str and isinstance(value, bool) else "")
        raise ValueError(f"{where} must be {tp.__name__}, got {value!r}{hint}")
    return value


def to_dict(config) -> dict:
    """JSON/YAML-ready form (round-trips through from_dict)."""
    return dataclasses.asdict(config)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """`a.b.c=value` pairs applied to nested `data` (a copy); values are parsed as YAML."""
    out = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not key=value (e.g. train.steps=100)")
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise ValueError(f"override {item!r}: {part} is not a mapping")
        node[leaf] = yaml.safe_load(raw)
    return out


def load_config(cls: type[C], recipe: str, overrides: list[str] = ()) -> C:
    """The `cls` config of `recipe` (a YAML file or 'module:function') with `overrides`."""
    return from_dict(cls, apply_overrides(recipe_fields(cls, recipe), list(overrides)),
                     where=recipe)


def recipe_fields(cls: type, recipe: str) -> dict:
    """The mapping of `cls` fields a recipe holds, before overrides and checks."""
    if os.path.isfile(recipe):
        with open(recipe) as f:
            data = yaml.safe_load(f)
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ValueError(f"{recipe} must hold a mapping of {cls.__name__} fields at the "
                             f"top level")
        return data
    module, sep, name = recipe.partition(":")
    if not sep or os.sep in module or module.endswith((".yaml", ".yml")):
        raise ValueError(f"recipe {recipe!r} is neither an existing YAML file nor "
                         f"module:function")
    try:
        make = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"recipe {recipe!r}: cannot load {name} from module {module} "
                         f"({e})") from None
    built = make()
    if isinstance(built, cls):
        return to_dict(built)
    if isinstance(built, dict):
        return built
    raise ValueError(f"{recipe} returned {type(built).__name__}, not a {cls.__name__} or a "
                     f"mapping of its fields")
