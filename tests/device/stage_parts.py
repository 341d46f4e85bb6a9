"""Ship large files to the device machine in parts, across back-to-back calls.

Each device call carries the working tree plus at most 64 MiB in all, so files larger than what
a call has room for travel split over several calls (the machine keeps what a call leaves in
``/root/keep`` while it stays warm, ~30 s between calls).

    python3 stage_parts.py split --room BYTES --prefix .bench --milestones NAME=ACTION,... FILE...
        (here) fills ``.bench1/``, ``.bench2/``, ... with consecutive parts of the files, in
        order, each folder at most ``room`` bytes; each gets ``manifest.json`` (every file's
        part count, size and sha256, and the call's actions: those of the files whose last
        part it carries, else "keep"; ``a+b=ACTION`` runs on the call completing the last of
        a and b). Refuses, in one line, a room too small to be useful.
    python3 stage_parts.py keep DIR KEEP
        (on the device) copies DIR's parts into KEEP and assembles every file whose parts are
        all there, checking its size and sha256; prints what is complete.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

MIN_ROOM = 4 << 20  # less room than this per call: the tree is too large for this staging


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def split(files: list[Path], room: int, prefix: str, milestones: dict[str, str], reserve: int = 16384) -> list[Path]:
    """Parts of ``files`` in call folders of at most ``room`` bytes (``reserve`` kept for the
    manifest). A call that completes a file named in ``milestones`` runs that action. Returns
    the folders; their number is the number of calls."""
    if room - reserve < MIN_ROOM:
        raise SystemExit(f"stage_parts: only {max(room, 0) / 1e6:.1f} MB of room per call (64 MiB minus the working "
                         f"tree and margin): the tree is too large to stage {sum(f.stat().st_size for f in files) / 1e6:.0f} "
                         f"MB this way; make the tree smaller (or ignore untracked files)")
    usable = room - reserve
    calls: list[list[tuple[str, int, int, int]]] = [[]]  # per call: (file, part, offset, length)
    free = usable
    counts: dict[str, int] = {}
    for f in files:
        size, offset, part = f.stat().st_size, 0, 0
        while offset < size or (size == 0 and part == 0):
            if free == 0:
                calls.append([])
                free = usable
            n = min(free, size - offset)
            calls[-1].append((f.name, part, offset, n))
            offset, free, part = offset + n, free - n, part + 1
            if size == 0:
                break
        counts[f.name] = part
    actions = milestone_actions(calls, counts, milestones)
    info = {f.name: {"parts": counts[f.name], "size": f.stat().st_size, "sha256": sha256(f)} for f in files}
    by_name = {f.name: f for f in files}
    folders = []
    for i, parts in enumerate(calls, 1):
        folder = Path(f"{prefix}{i}")
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        with_parts = []
        for name, part, offset, n in parts:
            with by_name[name].open("rb") as src, (folder / f"{name}.p{part:03d}").open("wb") as dst:
                src.seek(offset)
                dst.write(src.read(n))
            with_parts.append(f"{name}.p{part:03d}")
        action = actions[i - 1]
        (folder / "manifest.json").write_text(json.dumps({"call": i, "calls": len(calls), "action": action,
                                                          "parts": with_parts, "files": info}, indent=1))
        folders.append(folder)
    return folders


def milestone_actions(calls: list[list[tuple[str, int, int, int]]], counts: dict[str, int],
                      milestones: dict[str, str]) -> list[str]:
    """Each call's action: those of the milestones it completes, in the order their files
    complete, else "keep". A milestone ``a+b`` waits for all its files (the last one to complete
    decides the call, whatever order they travel in)."""
    done_at = {name: (i, j) for i, parts in enumerate(calls) for j, (name, part, _, _) in enumerate(parts)
               if part == counts[name] - 1}  # (call, position in it) of each file's last part
    due: list[tuple[tuple[int, int], str]] = []
    for key, action in milestones.items():
        names = key.split("+")
        unknown = [n for n in names if n not in done_at]
        if unknown:  # a typo would otherwise leave the benchmark unrun, silently
            raise SystemExit(f"stage_parts: milestone {key}={action} names a file not staged: {', '.join(unknown)}")
        due.append((max(done_at[n] for n in names), action))
    due.sort(key=lambda d: d[0])
    return ["+".join(dict.fromkeys(a for (call, _), a in due if call == i)) or "keep" for i in range(len(calls))]


def keep(folder: Path, store: Path) -> list[str]:
    """Copy ``folder``'s parts into ``store``; assemble complete files (checked). Returns the
    names of every file complete in ``store``."""
    store.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((folder / "manifest.json").read_text())
    for part in manifest["parts"]:
        shutil.copyfile(folder / part, store / part)
    complete = []
    for name, meta in manifest["files"].items():
        target = store / name
        if not target.exists():
            parts = [store / f"{name}.p{i:03d}" for i in range(meta["parts"])]
            if not all(p.exists() for p in parts):
                continue
            with (store / f".{name}.tmp").open("wb") as out:
                for p in parts:
                    with p.open("rb") as src:
                        shutil.copyfileobj(src, out)
            tmp = store / f".{name}.tmp"
            if tmp.stat().st_size != meta["size"] or sha256(tmp) != meta["sha256"]:
                tmp.unlink()
                raise SystemExit(f"stage_parts: {name} assembled from {len(parts)} parts does not match its sha256")
            os.replace(tmp, target)
            for p in parts:
                p.unlink()
        complete.append(name)
    return complete


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("--room", type=int, required=True)
    s.add_argument("--prefix", default=".bench")
    s.add_argument("--milestones", default="",
                   help="NAME=ACTION,...: the call completing NAME (NAME+NAME: the last of them) runs ACTION")
    s.add_argument("files", nargs="+", type=Path)
    k = sub.add_parser("keep")
    k.add_argument("folder", type=Path)
    k.add_argument("store", type=Path)
    args = ap.parse_args()
    if args.cmd == "split":
        milestones = dict(m.split("=", 1) for m in args.milestones.split(",") if m)
        folders = split(args.files, args.room, args.prefix, milestones)
        for f in folders:
            print(f"{f} {json.loads((f / 'manifest.json').read_text())['action']}")
    else:
        for name in keep(args.folder, args.store):
            print(f"complete: {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
