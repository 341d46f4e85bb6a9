"""Real text that ships with Tandem, for benchmarks that need long inputs (``tandem benchmark
--context`` and ``--agent-replay``): the documents among the shipped prompts
(``prompts.documents``) and Tandem's own engine source, read from the installed product (never
from anything beside it), in a fixed order, so a run's inputs depend only on the version.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from engine.errors import TandemError
from engine.prompts import documents

PACKAGE = "engine"


def product_root() -> Path:
    """The folder holding the ``engine`` package (and ``resources/`` beside it)."""
    return Path(__file__).resolve().parent.parent


def source_files() -> list[str]:
    """The engine's Python files as ``engine/...`` paths, sorted."""
    root = product_root()
    return sorted(p.relative_to(root).as_posix() for p in (root / PACKAGE).rglob("*.py"))


def source_text(path: str) -> str:
    """One of ``source_files``."""
    return (product_root() / path).read_text(encoding="utf-8")


def blocks(code_first: bool) -> Iterator[str]:
    """Long-context material, block by block: the shipped documents and the engine's source
    files (each headed by its path), code first or documents first."""
    docs = (f"{text}\n\n" for text in documents())
    code = (f"# {path}\n{source_text(path)}\n" for path in source_files())
    for part in (code, docs) if code_first else (docs, code):
        yield from part


def token_prefix(tokenizer: Any, tokens: int, code_first: bool) -> list[int]:
    """Exactly ``tokens`` token ids of ``blocks``, each block tokenized on its own (no special
    tokens), cut at ``tokens``."""
    ids: list[int] = []
    for block in blocks(code_first):
        if len(ids) >= tokens:
            break
        ids += list(tokenizer.encode(block, add_special_tokens=False))
    if len(ids) < tokens:
        raise TandemError(f"the shipped texts hold only {len(ids)} tokens for this tokenizer; ask for at most that")
    return ids[:tokens]
