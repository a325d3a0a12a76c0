"""The configuration reference, generated from the config dataclasses themselves: every field
a recipe can set (nested sections as dotted keys), its type, default and docstring (the string
literal under the field in its class's source). `python -m tools.config_reference` writes it to
docs/reference/config.md; a test fails when a field has no docstring or the file is stale.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing

from megarlhf.ppo.config import PPOConfig
from megarlhf.sft.config import DPOConfig, RMConfig, SFTConfig

COMMANDS = (("megarlhf ppo", PPOConfig), ("megarlhf sft", SFTConfig), ("megarlhf rm", RMConfig),
            ("megarlhf dpo", DPOConfig))


@dataclasses.dataclass(frozen=True)
class Entry:
    key: str
    """The recipe key, dotted below a section (`layout.actor.lora.rank`); `[]` marks a list
    of such sections (`rewards[].kind`)."""
    type: str
    default: str
    doc: str


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring under it, over `cls` and its dataclass bases."""
    docs = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:] + [None]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def entries(cls: type, prefix: str = "") -> list[Entry]:
    """Every field of config class `cls`, nested config sections expanded."""
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key, section = prefix + f.name, _section(hints[f.name])
        if section is not None:
            cls_, many = section
            out.append(Entry(key, _type_name(f.type), _default(f), docs.get(f.name, "")))
            out += entries(cls_, key + ("[]." if many else "."))
        else:
            out.append(Entry(key, _type_name(f.type), _default(f), docs.get(f.name, "")))
    return out


def render() -> str:
    """The reference page (Markdown)."""
    lines = ["# Configuration reference", "",
             "Generated from the config dataclasses by `python -m tools.config_reference`; do "
             "not edit by hand. A recipe (YAML) sets these keys, and `key=value` arguments "
             "override them; nested sections are dotted (`layout.actor.lora.rank=16`).", ""]
    for command, cls in COMMANDS:
        lines += [f"## `{command}` ({cls.__name__})", "",
                  "| key | type | default | meaning |", "|---|---|---|---|"]
        for e in entries(cls):
            # One table row: no line breaks, no cell separators, no HTML tags.
            doc = " ".join(e.doc.split()).replace("|", "\\|").replace("<", "&lt;")
            lines.append(f"| `{e.key}` | `{e.type}` | `{e.default}` | {doc} |")
        lines.append("")
    return "\n".join(lines)


def _section(tp) -> tuple[type, bool] | None:
    """(config class, is a list of them) when the type is a nested section, else None."""
    if dataclasses.is_dataclass(tp):
        return tp, False
    args = [a for a in typing.get_args(tp) if a is not type(None) and a is not Ellipsis]
    if len(args) == 1 and dataclasses.is_dataclass(args[0]):
        return args[0], typing.get_origin(tp) is tuple
    return None


def _type_name(tp) -> str:
    return (tp if isinstance(tp, str) else getattr(tp, "__name__", str(tp))).replace("|", "or")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):
            return "(section)"
    else:
        return "required"
    return repr(value)
