"""Checkpoint files are verified when they are read: a flipped byte inside a tensor, a damaged
archive header, a truncated, missing or unreadable file is named, never loaded as weights.
Both readers: the converters' (mapped pages) and every training load (megatron-core's
dist_checkpointing, which checks no CRC32 itself)."""

from __future__ import annotations

import glob
import os
import shutil
import zipfile

import pytest
import torch

from megarlhf.convert.chunk_file import data_record
from megarlhf.convert.mcore_io import single_rank_mesh
from megarlhf.errors import CorruptFileError
from megarlhf.integrity import ArchiveWindow, read_metadata, record_start, verify_checkpoint
from megarlhf.parallel.mesh import ParallelConfig
from tests.role_workers import checkpoint_tensors


@pytest.fixture(scope="module")
def intact(tmp_path_factory):
    from megarlhf.convert.hf_to_mcore import hf_to_mcore
    from tests import hf_models

    root = tmp_path_factory.mktemp("integrity")
    hf = hf_models.save_model(str(root / "hf"), "llama")
    hf_to_mcore(hf, str(root / "ckpt"), parallel=ParallelConfig())
    return str(root / "ckpt")


def _tensor_bytes_at(ckpt: str, key: str) -> tuple[str, int]:
    """(data file, offset of the first byte of `key`'s stored tensor data)."""
    metadata = read_metadata(ckpt)
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn == key)
    file = os.path.join(ckpt, info.relative_path)
    with open(file, "rb") as f:
        window = ArchiveWindow(f, info.offset, info.length)
        with zipfile.ZipFile(window) as zf:
            nbytes = next(i.file_size for i in zf.infolist() if "/data/" in i.filename)
        start, _ = data_record(window, nbytes, key)
    return file, info.offset + start


KEY = "decoder.layers.self_attention.linear_proj.weight"


def _damaged(intact: str, tmp_path, how: str) -> tuple[str, str]:
    """A copy of the checkpoint damaged `how`; returns (its path, the file named)."""
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(intact, ckpt)
    data = sorted(glob.glob(f"{ckpt}/*.distcp"))[0]
    if how == "flipped byte in a tensor":
        file, offset = _tensor_bytes_at(ckpt, KEY)
        with open(file, "r+b") as f:
            f.seek(offset + 100)
            byte = f.read(1)
            f.seek(offset + 100)
            f.write(bytes([byte[0] ^ 0x01]))
        return ckpt, file
    if how == "flipped byte in a tensor's data.pkl":  # the record torch.load unpickles
        info = next(s for i, s in read_metadata(ckpt).storage_data.items() if i.fqn == KEY)
        file = os.path.join(ckpt, info.relative_path)
        with open(file, "r+b") as f:
            window = ArchiveWindow(f, info.offset, info.length)
            with zipfile.ZipFile(window) as zf:
                pickle = next(i for i in zf.infolist() if i.filename.endswith("data.pkl"))
            offset = info.offset + record_start(window, pickle) + pickle.compress_size - 2
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x01]))
        return ckpt, file
    if how == "flipped byte in common.pt":  # megatron-core's own state, read by every rank
        file = f"{ckpt}/common.pt"
        with zipfile.ZipFile(file) as zf:
            record = next(i for i in zf.infolist() if i.filename.endswith("data.pkl"))
        with open(file, "r+b") as f:
            offset = record_start(f, record) + record.compress_size - 2
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x01]))
        return ckpt, file
    if how == "unreadable metadata.json":
        with open(f"{ckpt}/metadata.json", "w") as f:
            f.write('{"sharded_backend": ')
        return ckpt, f"{ckpt}/metadata.json"
    if how == "damaged archive header":
        file, offset = _tensor_bytes_at(ckpt, KEY)
        with open(file, "r+b") as f:  # the archive's first local header signature
            info = next(s for i, s in read_metadata(ckpt).storage_data.items() if i.fqn == KEY)
            f.seek(info.offset)
            f.write(b"XXXX")
        return ckpt, file
    if how == "truncated":
        os.truncate(data, os.path.getsize(data) // 2)
        return ckpt, data
    if how == "missing":
        os.remove(data)
        return ckpt, data
    if how == "unreadable metadata":
        with open(f"{ckpt}/.metadata", "r+b") as f:
            f.seek(10)
            f.write(b"\x00" * 40)
        return ckpt, f"{ckpt}/.metadata"
    raise AssertionError(how)


DAMAGE = ["flipped byte in a tensor", "flipped byte in a tensor's data.pkl",
          "damaged archive header", "truncated", "missing", "unreadable metadata"]
# Files only a training load reads (the converter reads the tensors' archives alone).
LOAD_ONLY_DAMAGE = ["flipped byte in common.pt", "unreadable metadata.json"]


@pytest.mark.parametrize("how", DAMAGE)
def test_the_converter_names_a_damaged_file_and_writes_nothing(intact, tmp_path, capsys, how):
    from tools.convert_hf import mcore_to_hf, run

    ckpt, named = _damaged(intact, tmp_path, how)
    out = tmp_path / "hf_out"
    with pytest.raises(SystemExit) as exit_:
        run(mcore_to_hf.main, ["--ckpt", ckpt, "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert "Traceback" not in err and named in err, err
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if "hf_out" in p]


@pytest.mark.parametrize("how", DAMAGE + LOAD_ONLY_DAMAGE)
def test_a_training_load_names_a_damaged_file(intact, tmp_path, how):
    from megarlhf.engine.checkpoint import engine_from_checkpoint

    ckpt, named = _damaged(intact, tmp_path, how)
    with single_rank_mesh() as mesh, pytest.raises(CorruptFileError) as failure:
        engine_from_checkpoint(ckpt, ParallelConfig(), mesh)
    assert named in str(failure.value) and "\n" not in str(failure.value)


def test_an_intact_checkpoint_verifies_and_loads_what_was_written(intact):
    from megarlhf.engine.checkpoint import engine_from_checkpoint

    verify_checkpoint(intact)
    written = checkpoint_tensors(intact)
    with single_rank_mesh() as mesh:
        engine = engine_from_checkpoint(intact, ParallelConfig(), mesh)
        loaded = engine.chunks[0].state_dict()
    proj = loaded["decoder.layers.0.self_attention.linear_proj.weight"]
    assert torch.equal(proj, written[KEY][0])


def test_verification_split_over_parts_covers_every_archive(intact, tmp_path):
    ckpt, _ = _damaged(intact, tmp_path, "flipped byte in a tensor")
    found = 0
    for part in range(3):
        try:
            verify_checkpoint(ckpt, part=part, parts=3)
        except CorruptFileError:
            found += 1
    assert found == 1  # exactly one part holds the damaged archive


def test_the_weights_fingerprint_follows_the_weights_not_the_save(intact, tmp_path):
    """An adapter-only LoRA checkpoint names its base by `checkpoint_weights_fingerprint`:
    equal for a copy and for the same model converted again (each save writes a new id into
    `.metadata`), another once a tensor's bytes change."""
    from megarlhf.convert.hf_to_mcore import hf_to_mcore
    from megarlhf.integrity import checkpoint_weights_fingerprint
    from tests import hf_models

    again = str(tmp_path / "again")
    hf_to_mcore(hf_models.save_model(str(tmp_path / "hf"), "llama"), again,
                parallel=ParallelConfig())
    with open(os.path.join(intact, ".metadata"), "rb") as a, \
            open(os.path.join(again, ".metadata"), "rb") as b:
        assert a.read() != b.read()  # what a fingerprint of the file would have refused
    fingerprint = checkpoint_weights_fingerprint(intact)
    assert checkpoint_weights_fingerprint(again) == fingerprint
    moved = str(tmp_path / "moved")
    shutil.copytree(intact, moved)
    assert checkpoint_weights_fingerprint(moved) == fingerprint
    file, offset = _tensor_bytes_at(moved, KEY)
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))
    assert checkpoint_weights_fingerprint(moved) != fingerprint
