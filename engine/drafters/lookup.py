"""Drafter-free n-gram lookup: propose what followed the longest earlier match of the context.

Prompt lookup pays on copy-heavy work (editing code, quoting, summarising with spans): when the
last few tokens occurred earlier, the tokens after that occurrence are a good guess. Longer
verbatim matches are more likely to continue, so they earn longer drafts. With a ``history``
(``engine/drafters/suffix.py``: earlier requests' prompts and outputs), a longer match there
wins over the context's own, and its draft is the most frequent continuation of the earlier
matches, as long as its estimated probability holds (``SuffixIndex.propose``).

``context=False`` drafts from the history only, and only where its match is ``min_history_match``
tokens or longer: the history-first lookup put in front of a model drafter (``engine/modes.py``),
where a repeated answer beats the model's guess and anything weaker does not.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import mlx.core as mx

from engine.drafters.base import Draft, Drafter
from engine.drafters.suffix import Proposal, SuffixIndex
from engine.sampling import Sampler

MIN_NGRAM = 3  # shorter keys fire often on chat and mostly miss (a net loss)
MAX_CANDIDATES = 8  # recent occurrences examined per round
MAX_MATCH = 64
STRONG_MATCH = MIN_NGRAM + 2  # a verbatim match this long is worth ending a parked plain run for


class LookupDrafter(Drafter):
    name = "lookup"

    def __init__(self, max_draft: int = 32, min_ngram: int = MIN_NGRAM, history: SuffixIndex | None = None, *,
                 context: bool = True, min_history_match: int = 0):
        self.max_draft = max_draft
        self.min_ngram = min_ngram
        # The request's index of earlier requests (``Engine.plan`` sets it per request: the API key's,
        # or None for a seeded sampled request, whose sample must not depend on earlier ones).
        self.history = history
        self.context = context
        self.min_history_match = min_history_match
        self.from_history = 0  # rounds drafted from the history (diagnostics, tests)
        self.history_tokens = 0  # tokens drafted from it
        self._index: dict[tuple[int, ...], list[int]] = defaultdict(list)
        self._indexed = 0  # positions < this have their n-gram ending there indexed
        self._ids: list[int] = []
        self._asked: tuple = ()  # (context length, index, its version): what ``_proposal`` holds
        self._proposal: Proposal | None = None

    def begin(self, prompt_ids: Sequence[int], hidden: mx.array | None) -> None:
        self._index.clear()
        self._indexed = 0
        self._ids = []
        self._asked = ()

    def _extend(self, ids: Sequence[int]) -> None:
        """Index every n-gram that ends before the current last token (whose continuation is
        known), by the position of the token that followed it. ``ids`` extends the context seen
        so far (the verify loop's committed tokens)."""
        if len(ids) < len(self._ids):  # another sequence: the loop's context only ever grows
            self.begin(ids, None)
        self._ids.extend(ids[len(self._ids):])  # the new tokens only: a plain step adds one
        if not self.context:
            return
        n = self.min_ngram
        for end in range(max(self._indexed, n), len(self._ids)):
            self._index[tuple(self._ids[end - n : end])].append(end)
        self._indexed = max(self._indexed, len(self._ids))

    def match(self, ids: Sequence[int]) -> tuple[int, int]:
        """(start of the continuation, match length) of the longest earlier match of the
        context's suffix; the latest occurrence wins a tie. (0, 0) when none."""
        self._extend(ids)
        n = self.min_ngram
        if len(self._ids) <= n or not self.context:
            return 0, 0
        key = tuple(self._ids[-n:])
        best_pos, best_len = 0, 0
        last = len(self._ids)
        for pos in reversed(self._index.get(key, [])[-MAX_CANDIDATES:]):
            if pos >= last:
                continue
            length = n
            while length < MAX_MATCH and pos - length - 1 >= 0 and self._ids[pos - length - 1] == self._ids[last - length - 1]:
                length += 1
            if length > best_len:
                best_pos, best_len = pos, length
        return best_pos, best_len

    def draft_length(self, match_len: int, cap: int) -> int:
        # A bare n-gram hit earns a short guess; each further matched token buys two more.
        return min(cap, self.max_draft, 4 + 2 * (match_len - self.min_ngram))

    def history_proposal(self) -> Proposal | None:
        """The history's proposal after the context seen so far (asked once per context length:
        ``draft_ready`` and ``propose`` ask in the same round), None when it has none worth drafting."""
        history = self.history
        if history is None:
            return None
        asked = (len(self._ids), history, history.version)
        if asked != self._asked:
            proposal = history.propose(self._ids, self.max_draft)
            self._proposal = proposal if proposal is not None and proposal.match >= self.min_history_match else None
            self._asked = asked
        return self._proposal

    def best(self, ids: Sequence[int]) -> tuple[list[int], int, bool]:
        """(continuation, match length, from the history) of the longest match: the context's
        own, or the history's where that one is longer (its draft length already chosen by its
        counts; the context's is the caller's ``draft_length``)."""
        start, length = self.match(ids)
        proposal = self.history_proposal()
        if proposal is not None and proposal.match > length:
            return proposal.tokens, proposal.match, True
        return self._ids[start: start + self.max_draft] if length else [], length, False

    def propose(self, ids: Sequence[int], cap: int, sampler: Sampler) -> Draft | None:
        tokens, length, from_history = self.best(ids)
        tokens = tokens[: min(cap, self.max_draft) if from_history else self.draft_length(length, cap)] if length else []
        if not tokens:
            return None
        self.from_history += from_history
        self.history_tokens += len(tokens) if from_history else 0
        return Draft(mx.array(tokens, dtype=mx.uint32))

    def commit(self, ids: Sequence[int], n_new: int, hidden: mx.array | None) -> None:
        self._extend(ids)

    def draft_ready(self, ids: Sequence[int]) -> bool:
        return self.best(ids)[1] > 0

    def cheap_draft_ready(self, ids: Sequence[int]) -> bool:
        return self.best(ids)[1] >= STRONG_MATCH

    def free_draft(self, ids: Sequence[int], cap: int, sampler: Sampler) -> Draft | None:
        return self.propose(ids, cap, sampler)
