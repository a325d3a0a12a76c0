"""The documentation site (mkdocs.yml, docs/): it builds with --strict (a broken link, a page
missing from the navigation or a bad mkdocstrings reference fails), the README stays a first
visit's page, and the troubleshooting page quotes only messages the code prints."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
SOURCES = [p for d in ("megarlhf", "tools") for p in (REPO / d).rglob("*.py")]


def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "python" / "index.html").read_text().count(
        "launch_local") > 1  # mkdocstrings rendered the code's docstrings


def test_the_readme_is_short_and_its_links_resolve():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert targets
    missing = [t for t in targets if "://" not in t and not (REPO / t).exists()]
    assert not missing, missing


def _fragments(message: str) -> list[str]:
    """The literal runs of a quoted message: between <...> placeholders, after `error: `."""
    body = message.removeprefix("error: ")
    return [part.strip() for part in re.split(r"<[^>]*>", body) if len(part.strip()) >= 12]


def test_every_troubleshooting_message_is_one_the_code_prints():
    page = (REPO / "docs" / "troubleshooting.md").read_text()
    messages = re.findall(r"```text\n(.*?)\n```", page, re.S)
    assert len(messages) >= 30
    source = "\n".join(p.read_text() for p in SOURCES)
    unknown = [(m, f) for m in messages for f in _fragments(m) if f not in source]
    assert not unknown, unknown


def test_the_message_check_catches_an_invented_message():
    source = "\n".join(p.read_text() for p in SOURCES)
    fragments = _fragments("error: <key> is a field no recipe has heard of <...>, sorry")
    assert fragments == ["is a field no recipe has heard of"]  # ", sorry" is too short
    assert fragments[0] not in source
