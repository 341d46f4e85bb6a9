"""DFlash drafter (z-lab ``*-DFlash-b16``): one block [anchor, MASK x (B-1)] through the
backbone, the target's own embedding and head, drafts from slots 1..B-1 (``logits_start=1``).

The slots are predicted independently (no chain), so greedy drafts are a row-wise argmax and
sampled drafts one categorical draw per row from the truncated distribution q.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from engine.drafters.base import Draft
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
        logits = self.logits(h)
        if sampler.greedy:
            return Draft(mx.argmax(logits, axis=-1).astype(mx.uint32))
        q = sampler.probs(logits)
        return Draft(sample_from(q, sampler.next_key()).astype(mx.uint32), q)
