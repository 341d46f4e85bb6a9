"""Drafts from earlier requests: an index over the prompts and outputs this process has seen.

Agent loops repeat themselves across requests (the same tool output, the same file quoted again,
the same edit pattern), and n-gram lookup only searches the current context. ``SuffixIndex``
keeps earlier token sequences of one model (``Engine.stream`` adds prompt + output of every
generation: server requests, app turns) and finds the longest earlier match of the current
context's suffix and what followed it there; ``LookupDrafter`` drafts from it when the context
itself has no match or a shorter one (SuffixDecoding, arXiv 2411.04975, drafts this way from a
suffix tree; an n-gram index with backward extension finds the same longest matches here).

Drafts never change the output (the verify decides), only the speed. Memory: a token budget,
least recently used sequences dropped whole; a sequence that extends a stored one (a chat's next
turn) replaces it. Not thread-safe: the engine's thread owns it.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import Sequence

MIN_NGRAM = 3
MAX_CANDIDATES = 8  # most recent occurrences examined per lookup
MAX_MATCH = 64
DEFAULT_BUDGET_TOKENS = 1 << 18  # about 30 MiB of Python ints with their postings


def _key(ngram: Sequence[int]) -> int:
    """An n-gram as one int (ids below 2**21: every vocabulary we load)."""
    key = 0
    for t in ngram:
        key = (key << 21) | t
    return key


class SuffixIndex:
    def __init__(self, budget_tokens: int = DEFAULT_BUDGET_TOKENS, ngram: int = MIN_NGRAM):
        self.budget_tokens = budget_tokens
        self.ngram = ngram
        self._seqs: OrderedDict[int, list[int]] = OrderedDict()  # least recently used first
        self._postings: dict[int, list[int]] = defaultdict(list)  # n-gram key -> seq << 32 | position after it
        self._stale = 0  # postings of dropped sequences (pruned by a rebuild once they outnumber the rest)
        self._next = 0
        self.tokens = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._seqs)

    def clear(self) -> None:
        """Forget every sequence (a benchmark's runs must not draft from each other's answers)."""
        self._seqs.clear()
        self._postings.clear()
        self._stale = self.tokens = 0

    def add(self, tokens: Sequence[int]) -> None:
        """Remember a sequence (a prompt and what was generated after it)."""
        tokens = [int(t) for t in tokens]
        if len(tokens) <= self.ngram:
            return
        for sid, seq in list(self._seqs.items()):
            if seq[0] != tokens[0]:
                continue
            if len(seq) <= len(tokens) and tokens[len(seq) - 1] == seq[-1] and tokens[: len(seq)] == seq:
                self._drop(sid)  # this one extends it
            elif len(seq) > len(tokens) and tokens == seq[: len(tokens)]:  # already known
                self._seqs.move_to_end(sid)
                return
        sid, self._next = self._next, self._next + 1
        self._seqs[sid] = tokens
        self.tokens += len(tokens)
        self._post(sid, tokens)
        while self.tokens > self.budget_tokens and len(self._seqs) > 1:
            self._drop(next(iter(self._seqs)))
            self.evictions += 1

    def _drop(self, sid: int) -> None:
        seq = self._seqs.pop(sid)
        self.tokens -= len(seq)
        self._stale += max(0, len(seq) - self.ngram)
        if self._stale > self.tokens:
            self._rebuild()

    def _post(self, sid: int, seq: list[int]) -> None:
        keys = list(seq)  # keys[i]: the n-gram starting at i, packed as ``_key`` does
        for k in range(1, self.ngram):
            keys = [(key << 21) | t for key, t in zip(keys, seq[k:])]
        postings, base = self._postings, sid << 32
        for end, key in zip(range(self.ngram, len(seq)), keys):  # n-grams with a token after them
            postings[key].append(base | end)

    def _rebuild(self) -> None:
        self._postings.clear()
        for sid, seq in self._seqs.items():
            self._post(sid, seq)
        self._stale = 0

    def match(self, context: Sequence[int], limit: int = MAX_MATCH) -> tuple[list[int], int]:
        """(the tokens that followed the longest earlier match of ``context``'s suffix, up to
        ``limit`` of them; the match length). ([], 0) when none; the latest wins a tie."""
        n = self.ngram
        if len(context) < n:
            return [], 0
        best: tuple[list[int], int, int] = ([], 0, 0)
        seen = 0
        for posting in reversed(self._postings.get(_key(context[-n:]), ())):
            sid, pos = posting >> 32, posting & 0xFFFFFFFF
            seq = self._seqs.get(sid)
            if seq is None or pos >= len(seq):
                continue
            length = n
            while (length < MAX_MATCH and pos - length - 1 >= 0 and length < len(context)
                   and seq[pos - length - 1] == context[-length - 1]):
                length += 1
            if length > best[2]:
                best = (seq, pos, length)
            seen += 1
            if seen >= MAX_CANDIDATES:
                break
        seq, pos, length = best
        return (seq[pos: pos + limit], length) if length else ([], 0)
