"""The prefix cache's disk tier against a second outside review: entries survive repeated restarts
of reuse; whoever can write the cache folder cannot change what the model says (forged entries,
crafted headers); temporary files a killed writer left are removed and live ones count toward
the cap. Tiny random engines (tests/tiny.py): seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib

import mlx.core as mx

from engine import prefix_disk
from engine.prefix_disk import file_mac, install_key, token_hash
from tests.test_prefix_cache import disk_engine, files, user


def _rewrite(good, folder, meta_edit, name: str | None = None):
    """A copy of the entry file ``good`` with its metadata edited, written into ``folder`` under
    ``name`` (default: listed before every real entry), as someone with write access could."""
    arrays, meta = mx.load(str(good), return_metadata=True)
    meta_edit(meta)
    path = folder / (name or f"000000000000000000000000-{'0' * 32}.safetensors")
    mx.save_safetensors(str(path), arrays, meta)
    return path


def test_disk_entries_survive_two_restarts_of_reuse(tmp_path):
    """A restored entry written back under its own name used to find that name in its 'absorbed'
    list and delete the file it had just written: one pass, and the next restart was cold."""
    prompt = user(40, 50)
    ref = disk_engine(tmp_path).generate(prompt, mode="baseline", max_new_tokens=6)
    for restart in range(2):
        engine = disk_engine(tmp_path)
        r = engine.generate(prompt, mode="baseline", max_new_tokens=6)
        assert r.cached_tokens == len(prompt) and r.token_ids == ref.token_ids, restart
        assert engine.prefix_cache.disk.loads == 1
        assert len(files(tmp_path)) == 1, restart


def test_crafted_headers_are_refused_and_removed_and_the_rest_still_serve(tmp_path):
    prompt = user(41, 40)
    ref = disk_engine(tmp_path).generate(prompt + [5], mode="baseline", max_new_tokens=6)
    (good,) = files(tmp_path)
    folder = good.parent

    def marks_as_list(meta):
        tree = json.loads(meta["tree"])
        tree["marks"] = [1, 2]
        meta["tree"] = json.dumps(tree)

    def deep_tree(meta):  # 10^5 levels: RecursionError in json and in the rebuild
        meta["tree"] = '{"final": ' + "[" * 100_000 + "]" * 100_000 + ', "marks": {}, "logits": {}, "drafters": []}'

    def floors_as_text(meta):
        meta["floors"] = json.dumps(["x"] * len(json.loads(meta["classes"])))

    for edit in (marks_as_list, deep_tree, floors_as_text):
        bad = _rewrite(good, folder, edit)
        engine = disk_engine(tmp_path)
        r = engine.generate(prompt + [5], mode="baseline", max_new_tokens=6)  # used to raise (a 500)
        assert r.token_ids == ref.token_ids and r.cached_tokens == len(prompt) + 1, edit.__name__
        assert not bad.exists() and engine.prefix_cache.disk.refused == 1, edit.__name__


def test_a_forged_entry_never_answers_another_prompt(tmp_path):
    """Prompt A's state relabelled with prompt B's tokens, under a name whose old-style checksum (or
    a keyed hash under another key) matches: B must be answered from B alone."""
    a, b = user(42, 40), user(43, 40)
    disk_engine(tmp_path).generate(a, mode="baseline", max_new_tokens=6)
    (good,) = files(tmp_path)
    cold_b = disk_engine(tmp_path).generate(b, mode="baseline", max_new_tokens=6, prefix_cache=False)

    def relabel(meta):
        meta["tokens"] = prefix_disk.encode_tokens(b + [7] * (len(prefix_disk.decode_tokens(meta["tokens"])) - len(b)))

    for sign in ("crc32", "other key"):
        forged = _rewrite(good, good.parent, relabel, name="forged.safetensors")
        data = forged.read_bytes()
        tag = f"{zlib.crc32(data):08x}" if sign == "crc32" else file_mac(data, b"k" * 32)
        forged = forged.rename(good.parent / f"{token_hash(b)}-{tag}.safetensors")
        engine = disk_engine(tmp_path)
        r = engine.generate(b, mode="baseline", max_new_tokens=6)
        assert r.cached_tokens == 0 and r.token_ids == cold_b.token_ids, sign
        assert not forged.exists(), sign
        for p in files(tmp_path):  # B's own entry, written by the cold run: not part of the next round
            if p != good:
                p.unlink()


def test_the_key_lives_outside_the_cache_and_is_private(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CONFIG_DIR", str(tmp_path / "config"))
    key = install_key()
    path = tmp_path / "config" / prefix_disk.KEY_FILE
    assert len(key) == 32 and path.stat().st_mode & 0o077 == 0
    assert install_key() == key  # kept
    path.write_text("not a key")
    assert install_key() not in (key, None) and len(install_key()) == 32  # a damaged key is replaced


def test_temporary_files_of_dead_writers_go_and_live_ones_count_toward_the_cap(tmp_path):
    engine = disk_engine(tmp_path)
    engine.prefix_cache.memory_bytes = 0  # straight through to disk
    engine.generate(user(44, 60), mode="baseline", max_new_tokens=4)
    (one,) = files(tmp_path)
    folder, size = one.parent, one.stat().st_size
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = folder / f".tmp-{int(dead.stdout)}-{'a' * 32}.safetensors"  # kill -9 mid-write
    killed.write_bytes(b"\0" * size)
    live = folder / f".tmp-{os.getppid()}-{'b' * 32}.safetensors"  # another process writing now
    live.write_bytes(b"\0" * size)

    fresh = disk_engine(tmp_path)
    fresh.prefix_cache.memory_bytes = 0
    fresh.prefix_cache.disk.max_bytes = int(size * 2.5)  # room for two entries, or one beside the live write
    fresh.generate(user(45, 60), mode="baseline", max_new_tokens=4)
    assert not killed.exists() and live.exists()
    assert len(files(tmp_path)) == 1  # the older entry made room for the live write
    on_disk = sum(p.stat().st_size for p in folder.iterdir())
    assert on_disk <= fresh.prefix_cache.disk.max_bytes
