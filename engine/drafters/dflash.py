"""DFlash drafter (z-lab ``*-DFlash-b16``): one block [anchor, MASK x (B-1)] through the
backbone, the target's own embedding and head, drafts from slots 1..B-1 (``logits_start=1``).

The slots are predicted independently (no chain), so greedy drafts are a row-wise argmax and
sampled drafts one categorical draw per row from the truncated distribution q.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from engine.drafters.base import Draft, propose_each
from engine.drafters.block import BlockDrafter
from engine.sampling import Sampler, sample_from


class DFlashDrafter(BlockDrafter):
    name = "dflash"

    def embed(self, ids: mx.array) -> mx.array:
        e = self.target.embed_tokens(ids)  # raw table rows, as z-lab feeds them
        scale = self.cfg.input_embedding_scale
        return e * scale if scale != 1.0 else e

    def logits(self, h: mx.array) -> mx.array:
        logits = self.target.head(h.astype(self.dtype))
        if self.cfg.output_multiplier != 1.0:
            logits = logits * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        if cap:
            logits = mx.tanh(logits / cap) * cap
        return logits

    def propose(self, ids: Sequence[int], cap: int, sampler: Sampler) -> Draft | None:
        cap = min(int(cap), self.max_draft)
        if cap <= 0:
            return None
        h = self.block_states(ids)[1 : 1 + cap]
        return self.draft(h, self.logits(h), int(ids[-1]), sampler)

    def draft(self, h: mx.array, logits: mx.array, anchor: int, sampler: Sampler) -> Draft:
        """The draft from the block's drafting slots: states h [k, H], their logits [k, V]."""
        if sampler.greedy:
            return Draft(mx.argmax(logits, axis=-1).astype(mx.uint32))
        q = sampler.probs(logits)
        return Draft(sample_from(q, sampler.next_key()).astype(mx.uint32), q)

    @staticmethod
    def propose_rows(requests: Sequence[tuple["DFlashDrafter", Sequence[int], int, Sampler]]) -> list[Draft | None]:
        """``propose`` for several sequences whose drafters share one model (rows of a batch,
        ``engine/batch.py``): one block forward serves every row (each over its own context), one
        head forward every row's slots; then each row drafts with its own sampler, as alone. Each
        row's draft is one ``propose`` could give it alone (the sums may differ in the last bits)."""
        caps = [min(int(cap), d.max_draft) for d, _, cap, _ in requests]
        live = [b for b, cap in enumerate(caps) if cap > 0]
        out: list[Draft | None] = [None] * len(requests)
        if len(live) < 2:
            return propose_each(requests, live, out)
        width = max(caps[b] for b in live)
        h = BlockDrafter.block_states_rows([requests[b][:2] for b in live])[:, 1 : 1 + width]
        logits = requests[live[0]][0].logits(h)
        for r, b in enumerate(live):
            drafter, ids, _, sampler = requests[b]
            out[b] = drafter.draft(h[r, : caps[b]], logits[r, : caps[b]], int(ids[-1]), sampler)
        return out
