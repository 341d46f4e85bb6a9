"""Prefix cache: never compute the same prompt twice (chat turns, server requests, restarts).

After a generation the ``Engine`` keeps what was computed for the tokens the target cached: the
target's caches, the drafter's state (DSpark/DFlash context K/V, the draft model's cache) and the
logits after the prompt, keyed by the token ids. A new prompt restores the longest stored prefix
it can and prefills only the rest, in every mode (``decode(..., resume=...)``).

* Full-attention caches are cut back to any shorter prefix by trimming. Caches that cannot be cut
  back (a sliding window that wrapped, recurrent state) are restored only at *marks*, snapshots
  taken at the end of a restored prefix, the end of each prompt and every ``MARK_EVERY`` prefill
  tokens, or at the entry's end.
* Exactness: a restored row is the target's own computation of that token, and prefill chunks
  keep their boundaries at multiples of ``PREFILL_CHUNK`` from token 0 (``Target.prefill``). On
  the CPU backend a row's result does not depend on which forward computed it, so a restore is
  bit-identical to a prefill from token 0 (tests/test_prefix_cache.py checks greedy and seeded
  sampled output). A prompt that is entirely a stored prefix needs the row after it: entries keep
  the logits after each prompt, else the last prompt token is prefilled again.
* Entries are never written to: they hold snapshots (``caches.snapshot``: new handles on the
  caches' buffers), and MLX copies a buffer that another handle still references instead of
  writing into it in place.
* Memory: entries in LRU order under a byte budget. An entry whose tokens extend another's absorbs
  it (its marks, logits and drafter states stay restorable). Disk (optional): ``prefix_disk``.
"""

from __future__ import annotations

import hashlib
import logging
import re
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from engine import caches, platform, prefix_disk
from engine.drafters.base import Drafter, DrafterState
from engine.speculative import DecodeStats, Resume
from engine.target import PREFILL_CHUNK, Target

log = logging.getLogger("tandem.prefix")

FORMAT = 1  # bump when what an entry holds changes meaning
MARK_EVERY = 4 * PREFILL_CHUNK  # prefill tokens between snapshots of caches that cannot be cut back
MEMORY_FRACTION = 0.25  # of the memory available when the engine starts
MIN_MEMORY_BYTES = 64 << 20
MAX_MEMORY_BYTES = 32 << 30
# Trimmable back to any prefix: the caches the verify trims, but a chunked one (it drops old rows).
APPEND_ONLY = tuple(c.__name__ for c in caches.TRIMMED if c is not caches.ChunkedKVCache)
_TAPPED = re.compile(r"(layers\.\d+)\.layer\.")


# ----------------------------------------------------------------------------------------
# Cache states
# ----------------------------------------------------------------------------------------
def arrays_of(tree: Any) -> list[mx.array]:
    return [v for _, v in tree_flatten(tree) if isinstance(v, mx.array)]


def floor(cls: str, state: Any, length: int) -> int:
    """The shortest prefix a layer cache (a ``caches.leaves`` member) of class ``cls`` in
    ``state``, holding ``length`` tokens, can be trimmed back to (``caches.trimmable_to``'s rule)."""
    if cls in APPEND_ONLY:
        return 0
    if cls == "RotatingKVCache":  # (keys, values, offset, keep, max_size, idx)
        return 0 if state[2] < state[4] else length  # once wrapped, older rows are gone
    if cls == "ChunkedKVCache":  # (keys, values, offset, chunk_size, start_position)
        return int(state[4])
    return length  # recurrent state (ArraysCache) and anything unknown: only where it stands


def layer_classes(cache: list) -> list[str]:
    return [type(c).__name__ for c in caches.leaves(cache)]


# ----------------------------------------------------------------------------------------
# Identity
# ----------------------------------------------------------------------------------------
def fingerprint(module: Any) -> str:
    """A short hash of a module's parameter names, shapes, dtypes and sampled values: another
    model, precision or retrained weights give another fingerprint."""
    h = hashlib.sha256()
    samples = []
    for name, p in sorted(tree_flatten(module.parameters()), key=lambda kv: kv[0]):
        name = _TAPPED.sub(r"\1.", name)  # a tapped layer (engine.target.TapLayer) is the same layer
        h.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
        flat = p.reshape(-1)
        n = flat.size
        samples += [flat[:16], flat[n // 2 : n // 2 + 16], flat[max(0, n - 16) :]]
    mx.eval(samples)
    for s in samples:
        h.update(bytes(memoryview(s.view(mx.uint8))))
    return h.hexdigest()[:32]


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def model_identity(target: Target) -> str:
    """What a stored target state depends on: weights, precision, cache layout and K/V bits,
    backend, versions."""
    classes = ",".join(layer_classes(target.new_cache()))
    return (f"tandem-prefix-{FORMAT}|weights {fingerprint(target.model)}|caches {classes} kv-bits {target.kv_bits}"
            f"|{platform.backend()}|mlx {mx.__version__}|mlx-lm {_version('mlx-lm')}")


def default_memory_bytes() -> int:
    """A quarter of the memory available now, within [64 MiB, 32 GiB]."""
    free = platform.available_memory_bytes()
    return int(min(MAX_MEMORY_BYTES, max(MIN_MEMORY_BYTES, free * MEMORY_FRACTION)))


# ----------------------------------------------------------------------------------------
# Entries
# ----------------------------------------------------------------------------------------
@dataclass
class Entry:
    """The state after ``tokens``. An entry listed from disk but not loaded has ``final`` None and
    None in place of its arrays (its positions and coverage are known)."""

    tokens: list[int]
    classes: list[str]  # the target's layer caches (``caches.leaves``), by class
    floors: list[int]  # per layer cache: the shortest prefix ``final`` can be trimmed back to
    final: list | None  # ``caches.snapshot`` after all of ``tokens``
    marks: dict[int, dict[int, Any]] = field(default_factory=dict)  # position -> {layer: state there}
    logits: dict[int, Any] = field(default_factory=dict)  # position -> the row predicting the token there
    drafters: dict[str, DrafterState] = field(default_factory=dict)  # drafter key -> its state
    path: Path | None = None  # its file in the disk tier
    dirty: bool = True  # not yet written to the disk tier
    absorbed: list[Path] = field(default_factory=list)  # disk files this entry now stands for

    @property
    def nbytes(self) -> int:
        trees = [self.final, self.marks, self.logits, [d.tree for d in self.drafters.values()]]
        return sum(a.nbytes for a in arrays_of(trees))

    def restorable(self, p: int) -> bool:
        if p == len(self.tokens):
            return True
        mark = self.marks.get(p, {})
        return all(f <= p or i in mark for i, f in enumerate(self.floors))

    def usable(self, prompt: Sequence[int], drafter_key: str | None, needs_state: bool) -> int:
        """The most prompt tokens this entry can restore for ``prompt`` (0: none)."""
        limit = caches.common_prefix(self.tokens, prompt)
        if needs_state:
            state = self.drafters.get(drafter_key) if drafter_key else None
            limit = min(limit, state.tokens) - state.lookahead if state else 0
        candidates = {limit, limit - 1, len(self.tokens), *self.marks}
        for p in sorted((p for p in candidates if 0 < p <= limit), reverse=True):
            # the whole prompt restored needs the row after it; else at least one token is prefilled
            if self.restorable(p) and (p < len(prompt) or p in self.logits):
                return p
        return 0

    def add_mark(self, p: int, layers: dict[int, Any]) -> None:
        """Keep these layers' states at position p where ``final`` cannot be trimmed back to p."""
        need = {i: s for i, s in layers.items() if self.floors[i] > p}
        if need and p < len(self.tokens):
            merged = self.marks.setdefault(p, {})
            for i, s in need.items():
                merged.setdefault(i, s)

    def absorb(self, shorter: "Entry") -> None:
        """Take over what ``shorter`` (whose tokens start this entry's) can restore."""
        m = len(shorter.tokens)
        if shorter.final is not None:
            self.add_mark(m, dict(enumerate(shorter.final)))
        for p, layers in shorter.marks.items():
            self.add_mark(p, layers)
        for p, row in shorter.logits.items():
            self.logits.setdefault(p, row)
        for key, state in shorter.drafters.items():
            if key not in self.drafters or self.drafters[key].tokens < state.tokens:
                self.drafters[key] = state
        self.absorbed += ([shorter.path] if shorter.path else []) + shorter.absorbed
        self.dirty = True


@dataclass
class Plan:
    """One generation's use of the store: where it resumes, and the marks it takes on the way."""

    prompt: list[int]
    drafter_key: str | None
    resume: Resume | None = None
    source: Entry | None = None
    marks: dict[int, dict[int, Any]] = field(default_factory=dict)
    mark: bool = False  # some cache cannot be cut back: take marks
    keep: list[int] = field(default_factory=list)  # more positions to mark (a chat's opening and turn boundary)

    @property
    def stops(self) -> list[int]:
        """Where the prefill must pause for a mark that falls inside a chunk (``decode``'s prefill_stops)."""
        start = self.resume.cached if self.resume is not None else 0
        return [p for p in self.keep if start < p < len(self.prompt)] if self.mark else []

    def on_prefill(self, n: int, cache: list) -> None:
        if not self.mark or n <= 0:
            return
        start = self.resume.cached if self.resume is not None else 0
        if n in (start, len(self.prompt)) or n % MARK_EVERY == 0 or n in self.keep:
            snap = caches.snapshot(cache)
            self.marks[n] = {i: snap[i] for i, cls in enumerate(layer_classes(cache)) if cls not in APPEND_ONLY}


NEXT_TURN = [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]


OPENING_MIN = 32  # a template's own opening shorter than this is not worth a snapshot
_PLACEHOLDERS = ("a", "b")  # two first user messages: the opening ends where their tokens part


def turn_boundary(render: Callable[[list[dict]], Sequence[int]], messages: Sequence[dict],
                  prompt_ids: Sequence[int]) -> int | None:
    """How many tokens of this chat prompt the next turn's prompt will share: the common prefix of
    ``prompt_ids`` with ``render`` (no generation prompt) of the messages plus a next exchange.

    It sits before the generation prompt's tail whenever a template renders that tail otherwise
    in history: Qwen3's empty ``<think></think>`` block with thinking off, or an opened reasoning
    block. A cache that cannot be cut back is restorable only where a snapshot was taken; one
    here (``PrefixCache.plan(keep=...)``) lets the next turn restore all of it instead of falling
    back to an earlier snapshot (the peer's 2-4 token miss at the boundary, costing the turn)."""
    return _shared(render, [*messages, *NEXT_TURN], prompt_ids)


def opening_end(render: Callable[[list[dict]], Sequence[int]], messages: Sequence[dict],
                prompt_ids: Sequence[int]) -> int | None:
    """How many tokens of this chat prompt its opening takes: all that comes before the first
    user message's words, as another conversation that opens the same way renders it (an
    agent's sub-agents and side requests, a new chat with the same system prompt). A snapshot
    there lets those restore all of it on a cache that cannot be cut back, not only up to the
    last ``MARK_EVERY`` tokens.

    The opening is where two placeholder first messages part, after the same system (or
    developer) message: it holds the system prompt with whatever the template renders beside it
    (tools), also where the template folds the system prompt into the first user turn (Gemma 3).
    Without a system message it is what the template writes on its own (the tools a client
    sends, a default system prompt), kept when it is ``OPENING_MIN`` tokens or more."""
    system = bool(messages) and messages[0].get("role") in ("system", "developer")
    if system and len(messages) < 2:  # the system message alone: the whole prompt is its opening
        return None
    head = list(messages[:1]) if system else []
    ends = [_shared(render, [*head, {"role": "user", "content": text}], prompt_ids) for text in _PLACEHOLDERS]
    if None in ends or (not system and min(ends) < OPENING_MIN):
        return None
    return min(ends)


def boundaries(render: Callable[[list[dict]], Sequence[int]], messages: Sequence[dict],
               prompt_ids: Sequence[int]) -> list[int]:
    """The prompt positions later prompts will likely depart at (``PrefixCache.plan(keep=...)``):
    the end of this chat's opening and where its next turn departs."""
    found = (opening_end(render, messages, prompt_ids), turn_boundary(render, messages, prompt_ids))
    return sorted({n for n in found if n is not None})


def _shared(render: Callable[[list[dict]], Sequence[int]], messages: list[dict], prompt_ids: Sequence[int]) -> int | None:
    try:
        ids = list(render(messages))
    except Exception:  # a template that wants other turns (alternation rules...): no boundary
        return None
    n = caches.common_prefix(ids, prompt_ids)
    return n if 0 < n < len(prompt_ids) else None


# ----------------------------------------------------------------------------------------
# The store
# ----------------------------------------------------------------------------------------
class PrefixCache:
    """Stored prefixes of one target (bound on first use), in memory and optionally on disk.
    Not thread-safe: the thread that runs the engine owns it."""

    def __init__(self, memory_bytes: int | None = None, *, disk_dir: str | Path | None = None,
                 disk_bytes: int | None = None, min_disk_tokens: int | None = None):
        self.memory_bytes = default_memory_bytes() if memory_bytes is None else max(0, int(memory_bytes))
        self.disk = None
        if disk_dir is not None:
            self.disk = prefix_disk.DiskTier(Path(disk_dir).expanduser(), Entry, disk_bytes, min_disk_tokens)
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self._next = 0
        self._identity: str | None = None
        self._target: Any = None  # weakref to the bound target
        self._kv_bits: int | None = None  # its K/V bits when bound
        self._keys: dict[int, tuple[Any, str]] = {}  # id(drafter model) -> (weakref, key)
        self.hits = self.misses = self.restored_tokens = self.evictions = 0

    # -- bookkeeping ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def entries(self) -> Iterator[Entry]:
        return iter(self._entries.values())

    def clear(self) -> None:
        """Release every in-memory entry (the disk tier keeps its files)."""
        self.flush()
        self._entries.clear()

    def _bind(self, target: Target) -> None:
        bound = self._target() if self._target is not None else None
        if bound is target and self._kv_bits == target.kv_bits:
            return
        self._entries.clear()
        self._kv_bits = target.kv_bits
        self._identity = model_identity(target)
        self._target = weakref.ref(target)
        if self.disk is not None:
            self.disk.bind(self._identity)

    def drafter_key(self, drafter: Drafter | None) -> str | None:
        """Which drafter a stored drafter state belongs to: its weights and tap layers."""
        model = getattr(drafter, "model", None) if drafter is not None else None
        if model is None:
            return None
        known = self._keys.get(id(model))
        if known is None or known[0]() is not model:
            known = (weakref.ref(model), f"{fingerprint(model)}|taps {list(drafter.tap_layers)}")
            self._keys[id(model)] = known
        return known[1]

    # -- lookup and restore --------------------------------------------------------------
    def plan(self, target: Target, drafter: Drafter | None, prompt: Sequence[int], keep: Sequence[int] = ()) -> Plan:
        """Find the longest stored prefix of ``prompt`` and restore it (``plan.resume``; None: none).
        ``keep``: prompt positions a later prompt will likely branch off at (``boundaries``)."""
        self._bind(target)
        prompt = list(prompt)
        key = self.drafter_key(drafter)
        needs = bool(drafter is not None and drafter.needs_state)
        plan = Plan(prompt, key, mark=any(cls not in APPEND_ONLY for cls in layer_classes(target.new_cache())),
                    keep=sorted(set(keep)))
        best, p = self._best(prompt, key, needs)
        if self.disk is not None:
            stub, q = self.disk.best(prompt, key, needs)
            loaded = self.disk.load(stub, target) if stub is not None and q > p else None
            if loaded is not None:
                self._insert(loaded)  # may merge with an entry in memory
                best, p = self._best(prompt, key, needs)
                q = loaded.usable(prompt, key, needs)
                if q > p:  # not kept in memory (no room): restore from it all the same
                    best, p = loaded, q
        if best is None or p == 0:
            self.misses += 1
            return plan
        for k, entry in self._entries.items():
            if entry is best:
                self._entries.move_to_end(k)
                break
        plan.resume, plan.source = self._restore(best, p, target, key), best
        if plan.resume is None:
            self.misses += 1
            return plan
        self.hits += 1
        self.restored_tokens += p
        return plan

    def _best(self, prompt: list[int], key: str | None, needs: bool) -> tuple[Entry | None, int]:
        best, p = None, 0
        for entry in reversed(self._entries.values()):  # most recent first
            q = entry.usable(prompt, key, needs)
            if q > p:
                best, p = entry, q
        return best, p

    def _restore(self, entry: Entry, p: int, target: Target, key: str | None) -> Resume | None:
        cache = target.new_cache()
        if layer_classes(cache) != entry.classes:
            log.warning("prefix cache: stored cache layout does not match the target's; entry dropped")
            self._entries = OrderedDict((k, e) for k, e in self._entries.items() if e is not entry)
            return None
        end = len(entry.tokens)
        trimmed = [p < end and f <= p for f in entry.floors]  # the rest come from the mark at p
        caches.restore(cache, [entry.final[i] if p == end or cut else entry.marks[p][i] for i, cut in enumerate(trimmed)])
        for layer, cut in zip(caches.leaves(cache), trimmed):
            if cut:
                caches.trim(layer, end - p)
        return Resume(cache, p, entry.logits.get(p), entry.drafters.get(key) if key else None)

    # -- storing -------------------------------------------------------------------------
    def remember(self, plan: Plan, stats: DecodeStats, drafter: Drafter | None) -> Entry | None:
        """Keep the state a generation left (``stats``) in memory. Returns the entry holding it."""
        cache, n = stats.cache, stats.cache_len
        if cache is None or n <= 0 or self._identity is None:
            return None
        sizes = {int(c.offset) for c in caches.leaves(cache) if hasattr(c, "offset")}
        if sizes - {n}:
            log.warning("prefix cache: caches hold %s tokens, expected %d; not kept", sorted(sizes), n)
            return None
        final = caches.compact_snapshot(cache)
        mx.eval(arrays_of(final))
        classes = layer_classes(cache)
        entry = Entry(list(stats.ids[:n]), classes, [floor(k, s, n) for k, s in zip(classes, final)], final)
        for p, layers in plan.marks.items():
            entry.add_mark(p, layers)
        if stats.prompt_logits is not None and len(plan.prompt) <= n:
            entry.logits[len(plan.prompt)] = stats.prompt_logits
        if drafter is not None and stats.drafter_ready and plan.drafter_key:
            state = drafter.state()
            if state is not None:
                mx.eval(arrays_of(state.tree))
                entry.drafters[plan.drafter_key] = replace(state, tokens=min(state.tokens, n))
        if plan.source is not None and plan.resume is not None:  # what the restored prefix offered
            p = plan.resume.cached
            source = plan.source
            for q, layers in source.marks.items():
                if q <= p:
                    entry.add_mark(q, layers)
            for q, row in source.logits.items():
                if q <= p:
                    entry.logits.setdefault(q, row)
            for k, state in source.drafters.items():
                if k not in entry.drafters and min(state.tokens, p) > 0:
                    entry.drafters[k] = replace(state, tokens=min(state.tokens, p))
        return self._insert(entry)

    def _insert(self, entry: Entry) -> Entry:
        for k, other in list(self._entries.items()):
            if entry.tokens[: len(other.tokens)] == other.tokens:
                entry.absorb(other)
                del self._entries[k]
            elif other.tokens[: len(entry.tokens)] == entry.tokens:
                other.absorb(entry)
                self._entries.move_to_end(k)
                self._evict()
                return other
        self._entries[self._next] = entry
        self._next += 1
        self._evict()
        return entry

    def _evict(self) -> None:
        sizes = {k: e.nbytes for k, e in self._entries.items()}
        total = sum(sizes.values())
        while self._entries and total > self.memory_bytes:
            k, entry = self._entries.popitem(last=False)
            total -= sizes[k]
            self.evictions += 1
            if self.disk is not None and entry.dirty:  # write-back: it may still pay after a restart
                self.disk.save(entry)

    def flush(self) -> None:
        """Write entries not yet on disk (the engine calls this once a reply is out)."""
        if self.disk is None:
            return
        for entry in list(self._entries.values()):
            if entry.dirty:
                self.disk.save(entry)

    def describe(self) -> str:
        text = (f"{len(self)} entries, {self.nbytes / 2**20:.1f} of {self.memory_bytes / 2**20:.0f} MiB in memory; "
                f"{self.hits} hits ({self.restored_tokens} tokens restored), {self.misses} misses")
        if self.disk is not None:
            text += f"; disk {self.disk.describe()}"
        return text
