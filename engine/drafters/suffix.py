"""Drafts from earlier requests: an index over the prompts and outputs this process has seen.

Agent loops repeat themselves across requests (the same tool output, the same file quoted again,
the same edit pattern), and n-gram lookup only searches the current context. ``SuffixIndex``
keeps earlier token sequences of one model (``Engine.stream`` adds prompt + output of every
generation: server requests, app turns) and proposes what followed the current context's suffix
there; ``LookupDrafter`` drafts from it when the context itself has no match or a shorter one.

Scoring follows SuffixDecoding (arXiv 2411.04975): of the earlier occurrences that match the
context's suffix, the continuation walks the most frequent next token at each step, and the
path's estimated probability (the product of each step's count over the occurrences still on
the path) decides the draft length: it stops below ``MIN_PATH_PROB``, and at ``SPEC_FACTOR``
tokens per matched token (a single earlier occurrence is certain by count alone, so the match
length bounds how far it is trusted). Several match lengths are tried (the longest matches only,
or every occurrence of the last n-gram) and the path with the most expected accepted tokens wins.

Why n-gram postings and not a suffix tree: the paper's tree counts children in its nodes, but in
Python a tree costs a node object per token (hundreds of bytes each) and a walk per insertion.
Postings (n-gram -> positions after it, as one int each) cost a few list slots per token, are
built with list comprehensions, and give the same counts: the occurrences of the last n-gram,
extended backwards, are the tree's matching suffixes, and counting what follows each is the
tree's child counts. Lookups examine at most ``MAX_OCCURRENCES`` recent occurrences, so a round
costs tens of microseconds whatever the index holds.

Drafts never change the output (the verify decides), only the speed. Memory: a token budget,
least recently used sequences dropped whole; a sequence that extends a stored one (a chat's next
turn) replaces it. Thread-safe (one lock): the engine thread drafts and adds, and a saver
(``engine/suffix_disk.py``) may read a snapshot from another thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Sequence

MIN_NGRAM = 3
MAX_OCCURRENCES = 32  # most recent occurrences of the last n-gram examined per lookup
MAX_MATCH = 64
MAX_GROUPS = 3  # match lengths tried per lookup (the longest ones, and the bare n-gram)
SPEC_FACTOR = 1.0  # at most this many draft tokens per matched token (SuffixDecoding's max_spec_factor)
MIN_PATH_PROB = 0.1  # a path less likely than this is not drafted further (SuffixDecoding's min_token_prob)
DEFAULT_BUDGET_TOKENS = 1 << 18  # about 30 MiB of Python ints with their postings


def _key(ngram: Sequence[int]) -> int:
    """An n-gram as one int (ids below 2**21: every vocabulary we load)."""
    key = 0
    for t in ngram:
        key = (key << 21) | t
    return key


@dataclass
class Proposal:
    """What the index proposes after a context: the most frequent continuation of its matches."""

    tokens: list[int]
    match: int  # the longest earlier match of the context's suffix (what lookup compares with its own)
    support: int  # earlier occurrences counted (those matching at least ``shared`` tokens)
    shared: int  # the match length the counted occurrences share
    prob: float  # the estimated probability of the whole path
    score: float  # expected accepted tokens: the sum of its prefixes' probabilities


def walk(occurrences: list[tuple[list[int], int]], depth: int, min_prob: float
         ) -> tuple[list[int], float, float]:
    """(tokens, probability, score) of the most frequent path after ``occurrences`` ((sequence,
    position of the token after the match), most recent first: it wins a tie), at most ``depth``
    tokens, stopping where the path's probability would fall below ``min_prob``."""
    tokens: list[int] = []
    prob, score = 1.0, 0.0
    alive = occurrences
    while len(tokens) < depth and alive:
        if len(alive) == 1:  # one occurrence left: its tokens, at the path's probability so far
            seq, pos = alive[0]
            rest = seq[pos + len(tokens): pos + depth]
            tokens += rest
            score += prob * len(rest)
            break
        d = len(tokens)
        counts: dict[int, int] = {}
        for seq, pos in alive:
            if pos + d < len(seq):
                t = seq[pos + d]
                counts[t] = counts.get(t, 0) + 1
        if not counts:
            break
        best = max(counts, key=counts.__getitem__)  # the first seen (most recent) wins a tie
        p = prob * counts[best] / len(alive)  # an occurrence whose sequence ended counts against it
        if p < min_prob:
            break
        prob = p
        score += p
        tokens.append(best)
        alive = [(seq, pos) for seq, pos in alive if pos + d < len(seq) and seq[pos + d] == best]
    return tokens, (prob if tokens else 0.0), score


class SuffixIndex:
    def __init__(self, budget_tokens: int = DEFAULT_BUDGET_TOKENS, ngram: int = MIN_NGRAM):
        self.budget_tokens = budget_tokens
        self.ngram = ngram
        self._seqs: OrderedDict[int, list[int]] = OrderedDict()  # least recently used first
        self._postings: dict[int, list[int]] = defaultdict(list)  # n-gram key -> seq << 32 | position after it
        self._stale = 0  # postings of dropped sequences (pruned by a rebuild once they outnumber the rest)
        self._next = 0
        self._lock = threading.Lock()
        self.tokens = 0
        self.evictions = 0
        self.version = 0  # bumped by every change (a save remembers the version it wrote)

    def __len__(self) -> int:
        return len(self._seqs)

    def clear(self) -> None:
        """Forget every sequence (a benchmark's runs must not draft from each other's answers)."""
        with self._lock:
            self._seqs.clear()
            self._postings.clear()
            self._stale = self.tokens = 0
            self.version += 1

    def sequences(self) -> list[list[int]]:
        """The stored sequences, least recently used first (what a save writes)."""
        with self._lock:
            return list(self._seqs.values())

    def add(self, tokens: Sequence[int]) -> None:
        """Remember a sequence (a prompt and what was generated after it)."""
        tokens = [int(t) for t in tokens]
        if len(tokens) <= self.ngram:
            return
        with self._lock:
            self._add(tokens)

    def _add(self, tokens: list[int]) -> None:
        for sid, seq in list(self._seqs.items()):
            if seq[0] != tokens[0]:
                continue
            if len(seq) >= len(tokens) and tokens == seq[: len(tokens)]:  # already known
                self._seqs.move_to_end(sid)
                return
            if len(seq) < len(tokens) and tokens[len(seq) - 1] == seq[-1] and tokens[: len(seq)] == seq:
                self._drop(sid)  # this one extends it
        sid, self._next = self._next, self._next + 1
        self._seqs[sid] = tokens
        self.tokens += len(tokens)
        self.version += 1
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

    def _occurrences(self, context: Sequence[int]) -> list[tuple[list[int], int, int]]:
        """(sequence, position after the match, match length) of the most recent earlier
        occurrences of ``context``'s last n-gram, most recent first, each extended backwards."""
        n = self.ngram
        if len(context) < n:
            return []
        found = []
        postings = self._postings.get(_key(context[-n:]), ())
        for posting in reversed(postings):
            seq = self._seqs.get(posting >> 32)
            pos = posting & 0xFFFFFFFF
            if seq is None or pos >= len(seq):
                continue
            length = n
            while (length < MAX_MATCH and pos - length - 1 >= 0 and length < len(context)
                   and seq[pos - length - 1] == context[-length - 1]):
                length += 1
            found.append((seq, pos, length))
            if len(found) >= MAX_OCCURRENCES:
                break
        return found

    def propose(self, context: Sequence[int], limit: int = MAX_MATCH, min_prob: float | None = None
                ) -> Proposal | None:
        """The most frequent continuation of ``context``'s earlier matches, as long as its
        estimated probability stays above ``min_prob`` (at most ``limit`` tokens, and
        ``SPEC_FACTOR`` per matched token); None when nothing matches. ``min_prob``: None for
        ``MIN_PATH_PROB``."""
        with self._lock:
            found = self._occurrences(context)
        if not found:
            return None
        lengths = sorted({length for _, _, length in found}, reverse=True)
        tried = lengths[: MAX_GROUPS - 1] + ([lengths[-1]] if len(lengths) >= MAX_GROUPS else [])
        best: Proposal | None = None
        for length in tried:  # the occurrences matching at least this long; the longest group first
            group = [(seq, pos) for seq, pos, n in found if n >= length]
            depth = min(limit, max(1, int(SPEC_FACTOR * length)))
            tokens, prob, score = walk(group, depth, MIN_PATH_PROB if min_prob is None else min_prob)
            if tokens and (best is None or score > best.score):
                best = Proposal(tokens, lengths[0], len(group), length, prob, score)
        return best
