"""The configuration reference (docs/reference/config.md) is generated from the config
dataclasses: every field a recipe can set has a docstring, and the committed file is what
they generate now."""

from __future__ import annotations

from megarlhf.config_reference import COMMANDS, entries, render
from tools.config_reference import PATH, main


def test_every_config_field_has_a_docstring():
    missing = [f"{command}: {e.key}" for command, cls in COMMANDS for e in entries(cls)
               if not e.doc]
    assert not missing, f"fields without a docstring (add one under the field): {missing}"


def test_the_reference_is_up_to_date(capsys):
    with open(PATH, encoding="utf-8") as f:
        assert f.read() == render(), "run python -m tools.config_reference"
    assert main(["--check"]) == 0


def test_nested_sections_are_dotted_and_lists_marked():
    keys = {e.key: e for e in entries(COMMANDS[0][1])}
    assert keys["layout.actor.lora.rank"].type == "int"
    assert "rewards[].weight" in keys and keys["rewards[].weight"].default == "1.0"
    assert keys["actor"].default == "required" and keys["layout"].default == "(section)"
