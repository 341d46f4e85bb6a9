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


def _payload(tmp_path, sizes: dict[str, int]) -> list[Path]:
    files = []
    for name, size in sizes.items():
        f = tmp_path / name
        f.write_bytes(os.urandom(size))
        files.append(f)
    return files


def test_the_pair_runs_on_the_call_completing_both_ggufs_in_either_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    room = (4 << 20) + 16384
    draft, target = "qwen2.5-coder-0.5b.gguf", "qwen2.5-coder-1.5b.gguf"
    # wheels first (their call benchmarks random8b), then the pair: stage_bench.sh sends the draft
    # first, but the milestone must not depend on that order
    for n, (first, second) in enumerate(((draft, target), (target, draft))):
        files = _payload(tmp_path, {"mlx.whl": 5 << 20, "gguf.whl": 1 << 20, first: 3 << 20, second: 9 << 20})
        folders = stage_parts.split(files, room, f".b{n}-", {"gguf.whl": "random8b", f"{draft}+{target}": "pair"})
        assert len(folders) == 5  # 18 MiB in 4 MiB calls
        assert all(sum(p.stat().st_size for p in f.iterdir()) <= room for f in folders)
        actions = [json.loads((f / "manifest.json").read_text())["action"] for f in folders]
        assert actions == ["keep", "random8b", "keep", "keep", "pair"]
        complete: list[str] = []
        for f in folders:
            complete = stage_parts.keep(f, tmp_path / f"keep{n}")
            if f != folders[-1]:
                assert second not in complete
        assert {draft, target} <= set(complete)


def test_two_milestones_completing_on_one_call_run_in_file_order_and_a_typo_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    files = _payload(tmp_path, {"a.whl": 1 << 10, "b.gguf": 2 << 10, "c.gguf": 3 << 10})
    folders = stage_parts.split(files, (4 << 20) + 16384, ".b", {"b.gguf+c.gguf": "pair", "a.whl": "random8b"})
    assert [json.loads((f / "manifest.json").read_text())["action"] for f in folders] == ["random8b+pair"]
    with pytest.raises(SystemExit, match="names a file not staged: d.gguf"):
        stage_parts.split(files, (4 << 20) + 16384, ".b", {"b.gguf+d.gguf": "pair"})
