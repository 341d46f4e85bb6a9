"""Training data for ``tandem train-drafter``: prompts, the target's own greedy answers, batches.

Self-distillation: a drafter is only ever asked to guess what *this* target will say, so its
training text is the target's own greedy answers to a set of prompts (DeepSpec regenerates its
training answers with the target the same way). Prompt files are JSON lines with one of
``{"turns": [first user turn, ...]}``, ``{"prompt": text}``, ``{"messages": [chat]}`` or
``{"text": text}``; only the first user turn is used.

Files written (JSON lines, ``.gz`` when the name ends so): one ``Example`` per line,
``{"source": "gsm8k", "prompt": [ids], "answer": [ids]}``. An answer ends with the target's EOS
token when the target stopped on its own, and is simply cut when it ran out of length; either
way every answer token is what greedy decoding of this target produces.

Batches are length-bucketed and reproducible from ``(seed, step)`` alone, so an interrupted run
resumes on exactly the batches and anchors it would have seen.
"""

from __future__ import annotations

import gzip
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from engine.errors import TandemError

# Prompt-set name -> content class (the benchmark's classes).
CONTENT_CLASSES = {
    "mt-bench": "chat", "mt_bench": "chat", "arena-hard": "chat", "arena-hard-v2": "chat", "alpaca": "chat",
    "humaneval": "code", "mbpp": "code", "livecodebench": "code",
    "gsm8k": "math", "math500": "math", "math": "math", "aime": "math",
}


def content_class(source: str) -> str:
    """'chat', 'code', 'math' or 'other' for a prompt-set name such as 'gsm8k' or 'mt-bench'."""
    return CONTENT_CLASSES.get(source.lower(), "other")


@dataclass
class Example:
    source: str
    prompt: list[int]
    answer: list[int] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.answer

    def to_json(self) -> str:
        return json.dumps({"source": self.source, "prompt": self.prompt, "answer": self.answer}, separators=(",", ":"))


# ----------------------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------------------
def prompt_text(record: Any) -> str | None:
    """The first user turn of one JSON-lines record, or None when it has none."""
    if isinstance(record, str):
        return record
    if not isinstance(record, dict):
        return None
    turns = record.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str):
        return turns[0]
    messages = record.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str):
                return m["content"]
    for key in ("prompt", "text", "question", "instruction"):
        if isinstance(record.get(key), str):
            return record[key]
    return None


def read_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """First user turns from a JSON-lines prompt file (blank lines skipped)."""
    path = Path(path)
    if not path.is_file():
        raise TandemError(f"prompt file {path} not found")
    out: list[str] = []
    with _open(path, "rt") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = prompt_text(json.loads(line))
            except ValueError:
                raise TandemError(f"{path}:{n}: not a JSON line") from None
            if text is None:
                raise TandemError(f"{path}:{n}: no prompt (expected 'turns', 'prompt', 'messages' or 'text')")
            if text.strip():
                out.append(text)
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise TandemError(f"prompt file {path} holds no prompts")
    return out


def source_name(path: str | Path) -> str:
    name = Path(path).name
    for suffix in (".gz", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name


def encode_prompts(files: Sequence[str | Path], encode: Callable[[str], list[int]], *,
                   max_prompt_tokens: int, limit_per_file: int | None = None) -> list[Example]:
    """Tokenize the prompts of each file (with the target's chat template, via ``encode``);
    prompts longer than ``max_prompt_tokens`` are skipped, not cut (a cut prompt is text the
    model never sees in use)."""
    out: list[Example] = []
    for f in files:
        src = source_name(f)
        for text in read_prompts(f, limit_per_file):
            ids = [int(t) for t in encode(text)]
            if 0 < len(ids) <= max_prompt_tokens:
                out.append(Example(src, ids))
    if not out:
        raise TandemError(f"no prompt of at most {max_prompt_tokens} tokens in {', '.join(map(str, files))}")
    return out


# ----------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------
def _open(path: Path, mode: str):
    return gzip.open(path, mode, encoding="utf-8") if path.suffix == ".gz" else open(path, mode, encoding="utf-8")


def save_examples(path: str | Path, examples: Iterable[Example]) -> Path:
    """Write atomically (a temp file renamed into place): an interrupted write leaves no half file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp" + (".gz" if path.suffix == ".gz" else ""))
    with _open(tmp, "wt") as f:
        for ex in examples:
            f.write(ex.to_json() + "\n")
    tmp.replace(path)
    return path


def load_examples(path: str | Path) -> list[Example]:
    path = Path(path)
    out = []
    try:
        with _open(path, "rt") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    r = json.loads(line)
                    out.append(Example(str(r["source"]), [int(t) for t in r["prompt"]], [int(t) for t in r.get("answer", [])]))
    except (OSError, ValueError, KeyError, TypeError, EOFError) as e:
        raise TandemError(f"{path}: unreadable examples file ({type(e).__name__}: {str(e)[:80]})") from None
    return out


# ----------------------------------------------------------------------------------------
# Answers (batched)
# ----------------------------------------------------------------------------------------
def decode_batch(model: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_ids: Sequence[int],
                 temperature: float = 0.0, seed: int = 0, prefill_chunk: int = 256) -> list[list[int]]:
    """Continue ``prompts`` together (left-padded, mlx-lm's ``BatchKVCache``): greedy when
    ``temperature`` is 0, else sampled at that temperature. Each continuation ends with its first
    EOS (kept) or after ``max_new_tokens``. One host read per 32 steps, so a GPU is never idle
    waiting for Python; rows that finished early keep decoding until all have (cheap: one batch)."""
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    n = len(prompts)
    width = max(len(p) for p in prompts)
    pad = [width - len(p) for p in prompts]
    x = mx.array([[0] * k + [int(t) for t in p] for k, p in zip(pad, prompts)], dtype=mx.uint32)
    cache = [BatchKVCache(pad) for _ in model.layers]
    for s in range(0, width, prefill_chunk):  # chunked prefill: bounded attention memory
        logits = model(x[:, s : s + prefill_chunk], cache=cache)[:, -1, :]
        mx.eval(logits)
    eos = mx.array(sorted({int(e) for e in eos_ids}) or [-1], dtype=mx.uint32)
    keys = mx.random.split(mx.random.key(seed), max_new_tokens) if temperature > 0 else None

    def pick(logits: mx.array, step: int) -> mx.array:
        if temperature <= 0:
            return mx.argmax(logits, axis=-1).astype(mx.uint32)
        return mx.random.categorical(logits.astype(mx.float32) / temperature, key=keys[step]).astype(mx.uint32)

    y = pick(logits, 0)
    done = mx.zeros((n,), dtype=mx.bool_)
    out = []
    for step in range(max_new_tokens):
        out.append(y)
        done = done | (y[:, None] == eos[None]).any(axis=-1)
        if step + 1 == max_new_tokens:
            break
        if step % 32 == 31 and done.all().item():
            break
        y = pick(model(y[:, None], cache=cache)[:, -1, :], step + 1)
        mx.async_eval(y, done)
    rows = mx.stack(out, axis=1).tolist()
    eos_set = {int(e) for e in eos_ids}
    result = []
    for row in rows:
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_set), len(row))
        result.append(row[:cut])
    return result


# Openings the target continues into its own user turns (``--self-prompt-openings builtin``):
# code-heavy and chat-heavy requests, the classes a starter drafter meets most; "" leaves the
# turn entirely to the target.
BUILTIN_OPENINGS = (
    "",
    "Write a Python function that", "Fix the bug in this Python code:\n```python\n", "Write a JavaScript function to",
    "Explain what this code does:\n```python\n", "Write a SQL query that", "Implement a Python class that",
    "Write a bash script that", "How do I read a file in", "Write unit tests for",
    "Can you explain", "What are the pros and cons of", "Write a short story about", "Give me some tips for",
    "Write an email to", "What is the difference between", "Summarize the following text:\n",
    "Solve step by step:", "How can I improve",
)


def self_prompt_openings(spec: str | None) -> list[str]:
    """The openings self-prompts start from: ``none`` (the target writes the whole turn),
    ``builtin`` (``BUILTIN_OPENINGS``), or a UTF-8 text file with one opening per line
    (``\\n`` in a line stands for a newline; a blank line is a turn left to the target)."""
    if spec in (None, "", "none"):
        return [""]
    if spec == "builtin":
        return list(BUILTIN_OPENINGS)
    path = Path(spec).expanduser()
    if not path.is_file():
        raise TandemError(f"--self-prompt-openings: {spec} is not 'none', 'builtin' or a text file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TandemError(f"--self-prompt-openings: cannot read {path} ({type(e).__name__})") from None
    openings = [line.replace("\\n", "\n") for line in lines]
    if not openings:
        raise TandemError(f"--self-prompt-openings: {path} is empty")
    return openings


def decode_all(model: Any, prompts: Sequence[Sequence[int]], *, batch_size: int, deadline: float | None = None,
               progress: Callable[[int, int, int], None] | None = None, **kw: Any) -> list[list[int] | None]:
    """``decode_batch`` over many prompts in length-sorted waves; None for prompts a
    ``deadline`` left undone."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int] | None] = [None] * len(prompts)
    done = tokens = 0
    seed = int(kw.pop("seed", 0))
    for w in range(0, len(order), batch_size):
        if deadline is not None and time.time() > deadline:
            break
        wave = order[w : w + batch_size]
        for i, ans in zip(wave, decode_batch(model, [prompts[i] for i in wave], seed=seed + w, **kw)):
            out[i] = ans
            tokens += len(ans)
        done += len(wave)
        if progress is not None:
            progress(done, len(prompts), tokens)
    return out


# ----------------------------------------------------------------------------------------
# Draft vocabulary (FR-Spec)
# ----------------------------------------------------------------------------------------
def draft_vocabulary(examples: Sequence[Example], vocab_size: int, *, coverage: float = 0.999,
                     minimum: int = 1024, always: Iterable[int] = ()) -> dict:
    """The ``draft_vocab.json`` content for a drafter trained on ``examples``: the answer
    tokens by frequency, as many as cover ``coverage`` of the answer tokens (at least
    ``minimum``, rounded up to a multiple of 256), plus ``always`` (EOS)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ex in examples:
        if ex.answer:
            np.add.at(counts, np.asarray(ex.answer, dtype=np.int64), 1)
    total = int(counts.sum())
    if total == 0:
        raise TandemError("no answer tokens to count for a draft vocabulary")
    order = np.argsort(-counts, kind="stable")
    cum = np.cumsum(counts[order]) / total
    n = int(np.searchsorted(cum, coverage)) + 1
    n = min(vocab_size, -(-max(n, minimum) // 256) * 256)
    ids = [int(i) for i in order[:n]]
    listed = set(ids)
    ids += [int(i) for i in always if 0 <= int(i) < vocab_size and int(i) not in listed]
    covered = float(counts[ids].sum()) / total
    return {"token_ids": ids, "coverage": round(covered, 6), "counted_tokens": total,
            "about": "tokens a DSpark drafter drafts from (FR-Spec), most frequent first, counted over the "
                     "target's own training answers; tandem --draft-vocab N keeps the first N, 0 disables"}


# ----------------------------------------------------------------------------------------
# Batches and anchors
# ----------------------------------------------------------------------------------------
def usable(examples: Sequence[Example], *, block_size: int, max_len: int) -> list[Example]:
    """Examples with at least one full block of answer, cut to ``max_len`` tokens."""
    out = []
    for ex in examples:
        if len(ex.prompt) + 1 >= max_len:
            continue
        ans = ex.answer[: max_len - len(ex.prompt)]
        if len(ans) >= 2:
            out.append(Example(ex.source, ex.prompt, ans))
    return out


def epoch_batches(lengths: Sequence[int], batch_seqs: int, seed: int, epoch: int) -> list[list[int]]:
    """One epoch of batches: a seeded shuffle, then length-sorted within windows of 16 batches
    (little padding, still random), the batches themselves shuffled again."""
    n = len(lengths)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(n)
    window = batch_seqs * 16
    batches = []
    for w in range(0, n, window):
        chunk = sorted(order[w : w + window], key=lambda i: lengths[i])
        batches += [list(map(int, chunk[b : b + batch_seqs])) for b in range(0, len(chunk), batch_seqs)]
    return [batches[i] for i in rng.permutation(len(batches))]


def batches_per_epoch(n: int, batch_seqs: int) -> int:
    window = batch_seqs * 16
    return sum(-(-min(window, n - w) // batch_seqs) for w in range(0, n, window))


def batch_at(lengths: Sequence[int], batch_seqs: int, seed: int, step: int) -> list[int]:
    """The batch of global step ``step`` (0-based): deterministic, so resuming is exact."""
    per = batches_per_epoch(len(lengths), batch_seqs)
    return epoch_batches(lengths, batch_seqs, seed, step // per)[step % per]


@dataclass
class Batch:
    """Arrays for one training step (numpy; the trainer moves them to the device).

    ids [S, T] right-padded with 0, anchors [S, A] (positions; 0 for unused slots), keep [S, A],
    labels [S, A, B] (token at anchor+k+1), prev [S, A, B] (token at anchor+k: the Markov
    head's previous token, the anchor itself for slot 0), valid [S, A, B] (label exists and
    lies in the answer, as a prefix), rows [S, A, B] (target row whose next-token distribution
    is the label's: anchor+k), sources [S]."""

    ids: np.ndarray
    lengths: np.ndarray
    anchors: np.ndarray
    keep: np.ndarray
    labels: np.ndarray
    prev: np.ndarray
    valid: np.ndarray
    rows: np.ndarray
    sources: list[str]


def make_batch(examples: Sequence[Example], *, block_size: int, num_anchors: int, rng: np.random.Generator,
               pad_to: int = 1, positions: Sequence[Sequence[int]] | None = None) -> Batch:
    """Pad the sequences and sample up to ``num_anchors`` anchors per sequence among answer
    positions p whose next token is also answer (DeepSpec's rule: anchor and first label in
    the loss mask). The block of anchor p is [x_p, MASK...] at positions p..p+B-1; slot k
    predicts x_{p+k+1}. ``positions``: each sequence's anchors, given (at most ``num_anchors``,
    among those positions) instead of sampled."""
    S, B = len(examples), block_size
    lengths = np.array([len(ex.prompt) + len(ex.answer) for ex in examples], dtype=np.int32)
    T = int(-(-lengths.max() // pad_to) * pad_to)
    ids = np.zeros((S, T), dtype=np.int32)
    anchors = np.zeros((S, num_anchors), dtype=np.int32)
    keep = np.zeros((S, num_anchors), dtype=bool)
    for s, ex in enumerate(examples):
        seq = ex.ids
        ids[s, : len(seq)] = seq
        cand = np.arange(len(ex.prompt), len(seq) - 1)  # anchor and its first label are answer tokens
        if positions is not None:
            cand = np.intersect1d(cand, np.asarray(positions[s], dtype=np.int64))[:num_anchors]
        elif len(cand) > num_anchors:
            cand = np.sort(rng.choice(cand, num_anchors, replace=False))
        anchors[s, : len(cand)] = cand
        keep[s, : len(cand)] = True
    k = np.arange(B)
    label_pos = anchors[:, :, None] + 1 + k  # [S, A, B]
    valid = keep[:, :, None] & (label_pos < lengths[:, None, None])
    safe = np.minimum(label_pos, T - 1)
    labels = np.take_along_axis(ids[:, None, :].repeat(num_anchors, 1), safe, axis=2)
    labels = np.where(valid, labels, 0).astype(np.int32)
    prev = np.concatenate([np.take_along_axis(ids, anchors, axis=1)[:, :, None], labels[:, :, :-1]], axis=2)
    rows = np.where(valid, label_pos - 1, 0).astype(np.int32)
    return Batch(ids, lengths, anchors, keep, labels, prev.astype(np.int32), valid, rows, [ex.source for ex in examples])
