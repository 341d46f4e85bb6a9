"""The benchmark prompt sets shipped with Tandem (``resources/prompts/``, sources and licenses
in its NOTICE), read by ``tandem benchmark`` and by the calibrator.

Two suites:

* ``classes``: chat (MT-Bench), code (HumanEval), math (MATH-500): 12 first user turns each.
  These are the starter drafter's held-out sets (it was trained on GSM8K, MBPP, Arena-Hard).
* ``spec-bench``: Spec-Bench's categories (multi-turn conversation, translation, summarization,
  question answering, mathematical reasoning, retrieval-augmented generation), 10 each.
  Multi-turn prompts are ``Turns``: the benchmark answers the first turn with the target's own
  greedy output and times the second.

``TANDEM_PROMPTS_DIR`` (or ``--prompts-dir``) points at another folder with the same file names.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Iterator, Sequence

from engine.errors import TandemError
from engine.paths import resources_dir

CLASSES = {"chat": "mt-bench.jsonl", "code": "humaneval.jsonl", "math": "math500.jsonl"}
SPEC_BENCH_FILE = "spec-bench.jsonl"
# Spec-Bench's table columns -> its question categories
SPEC_BENCH = {
    "multi-turn": ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"),
    "translation": ("translation",),
    "summarization": ("summarization",),
    "qa": ("qa",),
    "math": ("math_reasoning",),
    "rag": ("rag",),
}
SUITES = ("classes", "spec-bench")


@dataclass(frozen=True)
class Turns:
    """A conversation's user turns: every turn but the last gets the target's own answer first."""

    turns: tuple[str, ...]

    def __len__(self) -> int:
        return sum(len(t) for t in self.turns)

    def __getitem__(self, item):  # reports show the first turn's start
        return self.turns[0][item]


def prompts_dir() -> Path:
    env = os.environ.get("TANDEM_PROMPTS_DIR")
    return Path(env).expanduser() if env else resources_dir() / "prompts"


def _rows(path: Path) -> Iterator[dict]:
    """The file's rows, read (and checked) as far as the caller goes."""
    if not path.is_file():
        raise TandemError(f"benchmark prompts not found: {path} is missing (set TANDEM_PROMPTS_DIR or --prompts-dir "
                          f"to a folder holding {', '.join(list(CLASSES.values()) + [SPEC_BENCH_FILE])})")
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                turns = row["turns"]
                turns = [turns] if isinstance(turns, str) else list(turns)
                if not turns or not all(isinstance(t, str) for t in turns):
                    raise ValueError
            except (ValueError, KeyError, TypeError):
                raise TandemError(f"{path}:{n}: expected a JSON object with a 'turns' list of strings")
            yield dict(row, turns=turns)


def load_prompts(classes: Sequence[str] = ("chat", "code", "math"), per_class: int = 3,
                 folder: Path | None = None) -> list[tuple[str, str]]:
    """(class, first user turn) for the first ``per_class`` prompts of each class."""
    folder = folder or prompts_dir()
    out = []
    for cls in classes:
        if cls not in CLASSES:
            raise TandemError(f"unknown prompt class '{cls}': choose from {', '.join(CLASSES)}")
        for row in islice(_rows(folder / CLASSES[cls]), per_class):
            out.append((cls, row["turns"][0]))
    return out


def load_spec_bench(categories: Sequence[str] | None = None, per_category: int = 3,
                    folder: Path | None = None) -> list[tuple[str, str | Turns]]:
    """(category, prompt) for the first ``per_category`` questions of each Spec-Bench category;
    multi-turn questions come as ``Turns``."""
    folder = folder or prompts_dir()
    categories = list(categories or SPEC_BENCH)
    bad = [c for c in categories if c not in SPEC_BENCH]
    if bad:
        raise TandemError(f"unknown Spec-Bench category '{bad[0]}': choose from {', '.join(SPEC_BENCH)}")
    path = folder / SPEC_BENCH_FILE
    rows = list(_rows(path))
    out: list[tuple[str, str | Turns]] = []
    for cat in categories:
        picked = [row for row in rows if row.get("category") in SPEC_BENCH[cat]][:per_category]
        if not picked:
            raise TandemError(f"{path}: no questions of category '{cat}'")
        for row in picked:
            turns = row["turns"]
            out.append((cat, Turns(tuple(turns)) if len(turns) > 1 else turns[0]))
    return out


def load_conversations(n: int = 3, folder: Path | None = None) -> list[list[str]]:
    """The user turns of the first ``n`` chat prompts with two or more of them (MT-Bench has two
    each): the later turns measure the prefix cache (``tandem benchmark --multi-turn``)."""
    rows = (row["turns"] for row in _rows((folder or prompts_dir()) / CLASSES["chat"]))
    return list(islice((turns for turns in rows if len(turns) >= 2), n))


def documents(folder: Path | None = None) -> list[str]:
    """The long texts among the shipped prompts, in file order: Spec-Bench's CNN/Daily Mail
    articles (their "Summarize: " cut off) and its retrieval passages (their question, the last
    line, cut off). Real prose for benchmarks that need a long context before a prompt."""
    out = []
    for row in _rows((folder or prompts_dir()) / SPEC_BENCH_FILE):
        text = row["turns"][0]
        if row.get("category") == "summarization":
            out.append(text.removeprefix("Summarize:").strip())
        elif row.get("category") == "rag":
            out.append(text.rsplit("\n", 1)[0].strip())
    return out


def calibration_texts(per_class: int = 1, folder: Path | None = None) -> list[str]:
    """A few real prompts (first turns of each class) for measurements that need real text."""
    return [text for _, text in load_prompts(tuple(CLASSES), per_class, folder)]
