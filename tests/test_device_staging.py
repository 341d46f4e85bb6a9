"""The device staging helper (tests/device/stage_parts.py): files cut into per-call parts come back
whole, in any number of calls, and a tree that leaves no room is refused in one line."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("stage_parts", Path(__file__).parent / "device" / "stage_parts.py")
stage_parts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stage_parts)


def test_parts_fill_each_call_and_reassemble(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rng = __import__("random").Random(1)
    files = []
    for name, size in (("big.whl", 11 << 20), ("small.whl", 3 << 10), ("model.xz", 7 << 20)):
        f = tmp_path / name
        f.write_bytes(bytes(rng.getrandbits(8) for _ in range(64)) * (size // 64))
        files.append(f)
    room = (5 << 20) + 16384
    folders = stage_parts.split(files, room, ".bench", {"small.whl": "random8b", "model.xz": "starter"})
    assert [f.name for f in folders] == [".bench1", ".bench2", ".bench3", ".bench4"]  # 18 MiB in 5 MiB calls
    assert all(sum(p.stat().st_size for p in f.iterdir()) <= room for f in folders)
    actions = [json.loads((f / "manifest.json").read_text())["action"] for f in folders]
    assert actions == ["keep", "keep", "random8b", "starter"]  # the calls completing each milestone
    store = tmp_path / "keep"
    complete = []
    for f in folders:
        complete = stage_parts.keep(f, store)
    assert sorted(complete) == ["big.whl", "model.xz", "small.whl"]
    for f in files:
        assert (store / f.name).read_bytes() == f.read_bytes()
    assert sorted(os.listdir(store)) == ["big.whl", "model.xz", "small.whl"]  # parts removed once assembled


def test_a_damaged_part_and_a_full_tree_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    f = tmp_path / "x.whl"
    f.write_bytes(os.urandom(6 << 20))
    folders = stage_parts.split([f], (4 << 20) + 16384, ".b", {})
    part = next(folders[0].glob("x.whl.p*"))
    part.write_bytes(b"\0" + part.read_bytes()[1:])
    stage_parts.keep(folders[0], tmp_path / "store")
    with pytest.raises(SystemExit, match="does not match its sha256"):
        stage_parts.keep(folders[1], tmp_path / "store")
    with pytest.raises(SystemExit, match="the tree is too large to stage"):
        stage_parts.split([f], -3 << 20, ".b", {})
