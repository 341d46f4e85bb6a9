"""The one interface every drafter implements, so one verify loop serves them all.

Sequence state, shared by the loop and the drafter: ``ids`` are all committed tokens (prompt
and output). The last one, the *anchor*, has not been fed to the target yet; the target's KV
cache (and its tapped hidden rows) cover ``ids[:-1]``. Each round the drafter proposes tokens
to follow the anchor, the target verifies ``[anchor] + drafts`` in one forward, and the loop
commits the accepted prefix plus one token of the target's own. A drafter never decides what
is committed: it only changes how many target forwards the same output costs.

A prefix cache (``engine/prefix_cache.py``) may start a sequence from a stored prefix instead of
token 0: it keeps ``state()`` after a sequence and calls ``resume`` instead of ``begin`` on a
prompt that shares those tokens. A drafter's state can only change its speed, never the output.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn

from engine.sampling import Sampler


@dataclass
class Draft:
    """Proposed tokens [k] and, for sampling, the drafter's distribution q [k, V] at each.

    ``probs`` None means the drafts are deterministic (q is one-hot), as for n-gram lookup or
    any greedy drafter. Tokens may be a lazy array: the loop feeds them to the target without
    a host round trip.
    """

    tokens: mx.array
    probs: mx.array | None = None
    source: str = ""  # the drafter that made it, set by a drafter that mixes several (LookupFirst)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def keep(self, n: int) -> None:
        """Drop all but the first ``n`` drafts (a cap, or a batch's width)."""
        self.tokens = self.tokens[:n]
        self.probs = None if self.probs is None else self.probs[:n]


@dataclass
class DrafterState:
    """What a prefix cache keeps of a drafter after a sequence.

    ``tokens``: how many leading tokens of that sequence it covers. ``tree``: arrays in nested
    lists/dicts, with ints, strings or None beside them (saved to disk as is). The arrays must
    be handles that later writes to the drafter's live buffers never reach. ``lookahead``: the
    state after p tokens also read the next ones (a chain head's row t reads token t+1), so a
    resume after p tokens needs ``p + lookahead`` tokens to match."""

    tokens: int
    tree: Any
    lookahead: int = 0


class Drafter:
    """Base class. Subclasses override what they need; the defaults suit a stateless drafter."""

    #: short mode name shown in telemetry and summaries
    name: str = "drafter"
    #: target decoder layers whose outputs the drafter reads (empty: no tap needed)
    tap_layers: tuple[int, ...] = ()
    #: the most tokens one proposal can hold
    max_draft: int = 8
    #: whether proposals depend on the drafter's own model (for cost calibration)
    has_model: bool = False

    def speculation_blocker(self) -> str | None:
        """Why this drafter cannot draft exactly here (e.g. a draft model whose cache cannot roll
        back rejected drafts), or None."""
        return None

    def begin(self, prompt_ids: Sequence[int], hidden: mx.array | None) -> None:
        """A new sequence: the target has prefilled ``prompt_ids``; ``hidden`` holds the tapped
        rows for every prompt token (None without taps)."""

    def propose(self, ids: Sequence[int], cap: int, sampler: Sampler) -> Draft | None:
        """Up to ``cap`` tokens to follow ``ids[-1]``. None or an empty draft: no guess this round
        (the loop takes a plain target step)."""
        raise NotImplementedError

    def commit(self, ids: Sequence[int], n_new: int, hidden: mx.array | None) -> None:
        """The loop committed tokens: ``ids`` is the full sequence now, the last ``n_new`` are
        new. ``hidden`` holds the tapped rows for the tokens the target just cached (the previous
        anchor and the accepted drafts: ``n_new`` rows) or None."""

    def catch_up(self, ids: Sequence[int]) -> int:
        """Before a round: do now, and wait for, the work a proposal after ``ids`` would first
        spend on tokens it has not seen (a draft model's prefill of the prompt or of a parked
        run), so the loop times it apart from the round. Returns the tokens caught up (0: none)."""
        return 0

    def backlog_ms(self, ids: Sequence[int]) -> float:
        """What ``catch_up`` before a proposal after ``ids`` would cost now (ms, as this drafter
        measured its feeding): a batch weighs it before letting a row draft. 0: nothing to feed."""
        return 0.0

    def draft_ready(self, ids: Sequence[int]) -> bool:
        """Whether ``propose`` after ``ids`` may return a draft, as far as is known without a
        model call. False (n-gram lookup with no match) lets the loop take pipelined plain steps
        until there is one, where an empty round would be an unpipelined step each."""
        return True

    def cheap_draft_ready(self, ids: Sequence[int]) -> bool:
        """Whether a draft that costs next to nothing to make (a long n-gram match) and is
        likely to hold follows ``ids`` now: a parked ``--max-draft auto`` ends its plain run
        early to try it. Drafters whose every draft costs a model call say False."""
        return False

    def free_draft(self, ids: Sequence[int], cap: int, sampler: Sampler) -> Draft | None:
        """A draft of up to ``cap`` tokens that costs no model call (an n-gram match), or None: a
        batch verifies it in a row's padding, the width a round of other rows' drafts pays for
        anyway. Drafters whose every draft costs a model call have none."""
        return None

    @property
    def needs_state(self) -> bool:
        """Whether ``resume`` after a restored prefix needs a stored ``state()`` covering it: drafters
        that read the target's hidden states (a restored target cache does not give them back)."""
        return bool(self.tap_layers)

    def state(self) -> DrafterState | None:
        """The state after the committed tokens, for a prefix cache; None when there is nothing
        worth keeping (``resume`` rebuilds it from the tokens)."""
        return None

    def resume(self, prompt_ids: Sequence[int], cached: int, state: DrafterState | None,
               hidden: mx.array | None) -> None:
        """``begin`` for a sequence whose first ``cached`` prompt tokens the target restored
        instead of prefilling: ``hidden`` holds the tapped rows of ``prompt_ids[cached:]`` only.
        ``state``: what ``state()`` returned after an earlier sequence that starts with those
        tokens, or None. The default rebuilds from the tokens (drafters that read no hidden states)."""
        if self.tap_layers and cached:
            raise RuntimeError(f"{self.name} drafter cannot resume after a restored prefix without its state")
        self.begin(prompt_ids, hidden)

    def fork(self) -> "Drafter":
        """A drafter sharing this one's weights with a sequence state of its own, for one row of
        a batch. Containers are copied (``begin`` may clear them in place), drafters inside it
        (``LookupFirst``) forked, arrays and modules shared; ``begin``/``resume`` then reset the
        state, as they do for every new sequence."""
        twin = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, Drafter):
                setattr(twin, name, value.fork())
            elif isinstance(value, (list, dict, set)) and not isinstance(value, nn.Module):  # a Module is a dict
                setattr(twin, name, copy.copy(value))
        return twin


def propose_each(requests: Sequence[tuple[Drafter, Sequence[int], int, Sampler]], rows: Sequence[int],
                 out: list[Draft | None]) -> list[Draft | None]:
    """``out`` with each of ``rows`` (indices into ``requests``) proposed alone, by its own
    ``propose``: a batch's rows that cannot, or need not, share a forward."""
    for b in rows:
        drafter, ids, cap, sampler = requests[b]
        out[b] = drafter.propose(ids, cap, sampler)
    return out
