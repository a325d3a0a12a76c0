"""The converters never write over, into or around their input, and replace an existing output
only when it is ours (a megarlhf marker in it) or empty: each refusal exits 2 with one line
naming the path, and leaves every file that was there unchanged."""

from __future__ import annotations

import os
import shutil

import pytest

from megarlhf.convert.outputs import EXPORT_MARKER
from megarlhf.parallel.mesh import ParallelConfig
from tests.test_bad_inputs import tree


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from megarlhf.convert.hf_to_mcore import hf_to_mcore
    from tests import hf_models

    root = tmp_path_factory.mktemp("outputs")
    hf = hf_models.save_model(str(root / "hf"), "llama")
    hf_to_mcore(hf, str(root / "ckpt"), parallel=ParallelConfig())
    return root


def convert(tool: str, models, out, *extra) -> list[str]:
    if tool == "mcore_to_hf":
        return ["--ckpt", str(models / "ckpt"), "--out", str(out), *extra]
    return ["--hf", str(models / "hf"), "--out", str(out), *extra]


def run_tool(tool: str, argv: list[str], capsys) -> tuple[int, str]:
    from tools.convert_hf import hf_to_mcore, mcore_to_hf, run

    main = {"mcore_to_hf": mcore_to_hf.main, "hf_to_mcore": hf_to_mcore.main}[tool]
    with pytest.raises(SystemExit) as exit_:
        run(main, argv)
    return exit_.value.code, capsys.readouterr().err


def refused(tool, argv, capsys, root, names: str) -> None:
    before = tree(root)
    code, err = run_tool(tool, argv, capsys)
    assert code == 2 and "Traceback" not in err and names in err, err
    assert tree(root) == before  # nothing written, nothing removed


TOOLS = ["mcore_to_hf", "hf_to_mcore"]
INPUT = {"mcore_to_hf": "ckpt", "hf_to_mcore": "hf"}


@pytest.mark.parametrize("tool", TOOLS)
def test_out_equal_to_the_input_is_refused_even_with_force(models, capsys, tool):
    refused(tool, convert(tool, models, models / INPUT[tool], "--force"), capsys, models,
            names=f"is the input {models / INPUT[tool]}")


@pytest.mark.parametrize("tool", TOOLS)
def test_out_inside_the_input_is_refused(models, capsys, tool):
    refused(tool, convert(tool, models, models / INPUT[tool] / "sub", "--force"), capsys,
            models, names="is inside the input")


@pytest.mark.parametrize("tool", TOOLS)
def test_out_around_the_input_is_refused(models, capsys, tool):
    refused(tool, convert(tool, models, models, "--force"), capsys, models,
            names="contains the input")


@pytest.mark.parametrize("tool", TOOLS)
def test_an_unrelated_directory_is_not_replaced_even_with_force(models, capsys, tool, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    refused(tool, convert(tool, models, mine, "--force"), capsys, tmp_path,
            names=f"{mine} exists and was not written by megarlhf")


@pytest.mark.parametrize("tool", TOOLS)
def test_an_existing_output_needs_force(models, capsys, tool, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / EXPORT_MARKER).write_text("{}")
    refused(tool, convert(tool, models, out), capsys, tmp_path,
            names="already exists; pass --force")


@pytest.mark.parametrize("tool", TOOLS)
def test_a_file_at_or_above_out_is_refused(models, capsys, tool, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    refused(tool, convert(tool, models, a_file, "--force"), capsys, tmp_path,
            names=f"{a_file} is a file")
    refused(tool, convert(tool, models, a_file / "out"), capsys, tmp_path,
            names=f"{a_file} is a file, not a directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through any permission")
@pytest.mark.parametrize("tool", TOOLS)
def test_a_read_only_parent_is_named(models, capsys, tool, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        code, err = run_tool(tool, convert(tool, models, locked / "out"), capsys)
    finally:
        locked.chmod(0o700)
    assert code == 2 and "Traceback" not in err and str(locked) in err, err


@pytest.mark.parametrize("tool", TOOLS)
def test_force_replaces_our_own_output_and_nothing_beside_it(models, capsys, tool, tmp_path):
    out = tmp_path / "out"
    assert run_tool(tool, convert(tool, models, out), capsys)[0] == 0
    # What a user may keep next to an output, under the names converters once used.
    for sibling in ("out.tmp", "out.old"):
        (tmp_path / sibling).mkdir()
        (tmp_path / sibling / "keep.txt").write_text("mine")
    first = tree(out)
    assert run_tool(tool, convert(tool, models, out, "--force"), capsys)[0] == 0
    assert sorted(os.listdir(tmp_path)) == ["out", "out.old", "out.tmp"]
    for sibling in ("out.tmp", "out.old"):
        assert (tmp_path / sibling / "keep.txt").read_text() == "mine"
    assert {os.path.relpath(p, out) for p in tree(out)} == \
        {os.path.relpath(p, out) for p in first}


def test_an_export_carries_its_marker_and_loads_in_transformers(models, capsys, tmp_path):
    import transformers

    out = tmp_path / "export"
    assert run_tool("mcore_to_hf", convert("mcore_to_hf", models, out), capsys)[0] == 0
    assert (out / EXPORT_MARKER).is_file()
    transformers.AutoModelForCausalLM.from_pretrained(str(out))
    # Converting the export back keeps the marker out of the checkpoint's sidecar.
    back = tmp_path / "back"
    from tools.convert_hf import hf_to_mcore, run

    with pytest.raises(SystemExit) as exit_:
        run(hf_to_mcore.main, ["--hf", str(out), "--out", str(back)])
    assert exit_.value.code == 0
    assert not (back / "hf" / EXPORT_MARKER).exists()


def test_a_stale_temporary_of_ours_is_cleared_and_a_foreign_one_refused(models, capsys,
                                                                        tmp_path):
    from megarlhf.convert.outputs import temporary_sibling

    out = tmp_path / "out"
    stale = temporary_sibling(str(out))
    os.makedirs(stale)
    (tmp_path / ".out.megarlhf-tmp" / "half.bin").write_text("")
    refused("mcore_to_hf", convert("mcore_to_hf", models, out), capsys, tmp_path,
            names="is not a temporary directory of ours")
    shutil.rmtree(stale)
    assert run_tool("mcore_to_hf", convert("mcore_to_hf", models, out), capsys)[0] == 0
    assert not os.path.exists(stale)
