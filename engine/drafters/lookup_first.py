"""Lookup first: n-gram lookup when the context repeats itself, a model drafter otherwise.

Copy-heavy stretches (code being edited, a list being continued, a quoted span) are where
n-gram lookup drafts long and right at no cost; elsewhere it has nothing, and a trained drafter
(DSpark, DFlash) guesses from the target's hidden states. Each round takes lookup's draft when
it has one, else the model drafter's. Which one drafts depends only on the committed tokens,
and the verify rule receives the q of the draft it got, so output is the target's own either
way. Both drafters see every commit, so either can draft the next round.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from engine.drafters.base import Draft, Drafter, DrafterState
from engine.drafters.lookup import LookupDrafter
from engine.sampling import Sampler


class LookupFirst(Drafter):
    has_model = True

    def __init__(self, model_drafter: Drafter, lookup: LookupDrafter | None = None):
        self.model_drafter = model_drafter
        self.lookup = lookup or LookupDrafter()
        self.name = f"{model_drafter.name}+lookup"
        self.tap_layers = model_drafter.tap_layers
        self.max_draft = max(self.lookup.max_draft, model_drafter.max_draft)
        self.from_lookup = 0  # rounds drafted by each (diagnostics, tests)
        self.from_model = 0

    @property
    def model(self):
        """The model drafter's weights (what calibration keys and prices)."""
        return getattr(self.model_drafter, "model", None)

    def speculation_blocker(self) -> str | None:
        return self.model_drafter.speculation_blocker()

    def begin(self, prompt_ids: Sequence[int], hidden: mx.array | None) -> None:
        self.lookup.begin(prompt_ids, hidden)
        self.model_drafter.begin(prompt_ids, hidden)

    def propose(self, ids: Sequence[int], cap: int, sampler: Sampler) -> Draft | None:
        draft = self.lookup.propose(ids, cap, sampler)
        if draft is not None and len(draft):
            self.from_lookup += 1
            draft.source = self.lookup.name
            return draft
        self.from_model += 1
        draft = self.model_drafter.propose(ids, min(cap, self.model_drafter.max_draft), sampler)
        if draft is not None:
            draft.source = self.model_drafter.name
        return draft

    @staticmethod
    def propose_rows(requests: Sequence[tuple["LookupFirst", Sequence[int], int, Sampler]]) -> list[Draft | None]:
        """``propose`` for several rows whose model drafters share one model (rows of a batch):
        each row's lookup first, as alone; the rows it leaves without a draft propose together
        through the model drafter's ``propose_rows`` (one at a time where it has none)."""
        out: list[Draft | None] = [None] * len(requests)
        rest = []
        for b, (drafter, ids, cap, sampler) in enumerate(requests):
            draft = drafter.lookup.propose(ids, cap, sampler)
            if draft is not None and len(draft):
                drafter.from_lookup += 1
                draft.source = drafter.lookup.name
                out[b] = draft
            else:
                drafter.from_model += 1
                rest.append(b)
        if not rest:
            return out
        inner = [(requests[b][0].model_drafter, requests[b][1], min(requests[b][2], requests[b][0].model_drafter.max_draft),
                  requests[b][3]) for b in rest]
        together = getattr(inner[0][0], "propose_rows", None)
        made = together(inner) if together is not None else [d.propose(ids, cap, s) for d, ids, cap, s in inner]
        for b, (model_drafter, *_), draft in zip(rest, inner, made):
            if draft is not None:
                draft.source = model_drafter.name
            out[b] = draft
        return out

    def commit(self, ids: Sequence[int], n_new: int, hidden: mx.array | None) -> None:
        self.lookup.commit(ids, n_new, hidden)
        self.model_drafter.commit(ids, n_new, hidden)

    def catch_up(self, ids: Sequence[int]) -> int:
        return self.model_drafter.catch_up(ids)

    def backlog_ms(self, ids: Sequence[int]) -> float:
        return self.model_drafter.backlog_ms(ids)

    def cheap_draft_ready(self, ids: Sequence[int]) -> bool:
        return self.lookup.cheap_draft_ready(ids)

    def free_draft(self, ids: Sequence[int], cap: int, sampler: Sampler) -> Draft | None:
        draft = self.lookup.free_draft(ids, cap, sampler)
        if draft is not None:
            draft.source = self.lookup.name
        return draft

    def state(self) -> DrafterState | None:
        return self.model_drafter.state()  # lookup's index is rebuilt from the tokens

    def resume(self, prompt_ids: Sequence[int], cached: int, state: DrafterState | None,
               hidden: mx.array | None) -> None:
        self.lookup.begin(prompt_ids, hidden)
        self.model_drafter.resume(prompt_ids, cached, state, hidden)
