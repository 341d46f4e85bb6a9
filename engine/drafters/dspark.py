"""DSpark drafter: B drafts from the B block slots (the anchor's slot predicts the first),
chained left to right through the Markov head, optionally cut short by the confidence head.

Slot k's logits are ``lm_head(h_k) + W2·W1[x_{k-1}]`` with x_0 the anchor and x_{k-1} the token
actually chosen at slot k-1 (argmax when greedy, a sample from the truncated distribution q_k
when sampling; q_k is what the verify rule receives). The confidence head scores slot k from
``[h_k; W1[x_{k-1}]]``, and the draft is cut by one of two rules: ``slot`` (DeepSpec's
evaluator, the family's published behaviour and the default) stops at the first slot whose own
score is below the threshold; ``product`` keeps slots while the running product of the scores
stays at or above it (shorter drafts). Either decision for slot k depends only on the tokens
before it, so it is a stopping rule and the verify rule stays exact; greedy output never
changes. The calibrator picks the rule and threshold that pay on this machine
(``engine/calibrate.py``): where a longer verify costs little, longer drafts win.

With a draft vocabulary (the drafter folder's ``draft_vocab.json``, FR-Spec), the head and the
Markov output keep only the listed tokens' rows: a proposal reads N x H head weights instead of
V x H, drafts are drawn from the listed tokens only, and q is zero elsewhere. The verify rule
is exact for any q that drafts are really drawn from, so this changes speed, never output.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Callable, Sequence

import mlx.core as mx

from engine.drafters.base import Draft
from engine.drafters.block import BlockConfig, BlockDrafter, DSparkModel
from engine.errors import TandemError
from engine.sampling import Sampler, pick_rows, sample_from, spread_to_vocab

if TYPE_CHECKING:
    from engine.target import Target


def chain_tokens(model: DSparkModel, h: mx.array, anchor: int, sampler: Sampler, vocab: mx.array | None = None
                 ) -> tuple[mx.array, mx.array | None, mx.array]:
    """Draft tokens [k], their distributions q [k, V] (None when greedy) and the previous
    token of each slot [k] from block states h [k, H]. All lazy.

    ``vocab`` [N]: the token ids of the logits' columns when the head was restricted to a
    draft vocabulary; q is then zero outside it (drafts are still exact samples of q)."""
    base = model.logits(h)
    to_token = (lambda i: i) if vocab is None else (lambda i: vocab[i])
    head = getattr(model, "markov_head", None)
    prev = mx.array(anchor, dtype=mx.uint32)
    if head is None:  # no chain: every slot is independent
        if sampler.greedy:
            q, tokens = None, to_token(mx.argmax(base, axis=-1)).astype(mx.uint32)
        else:
            q = sampler.probs(base)
            tokens = to_token(sample_from(q, sampler.next_key())).astype(mx.uint32)
        return tokens, spread_to_vocab(q, vocab, model.cfg.vocab_size) if q is not None else None, \
            mx.concatenate([prev[None], tokens[:-1]])
    state = head.initial_state(h.dtype)
    tokens, probs, prevs = [], [], []
    for k in range(h.shape[0]):
        bias, state = head.step(prev, h[k], state)
        logits = base[k] + bias
        prevs.append(prev)
        if sampler.greedy:
            tok = mx.argmax(logits)
        else:
            q = sampler.probs(logits)
            probs.append(q)
            tok = sample_from(q, sampler.next_key())
        prev = to_token(tok).astype(mx.uint32)
        tokens.append(prev)
    q = spread_to_vocab(mx.stack(probs), vocab, model.cfg.vocab_size) if probs else None
    return mx.stack(tokens), q, mx.stack(prevs)


def chain_rows(model: DSparkModel, h: mx.array, anchors: Sequence[int], samplers: Sequence[Sampler],
               vocab: mx.array | None = None) -> tuple[mx.array, list[mx.array | None], mx.array]:
    """``chain_tokens`` for B sequences at once: block states h [B, k, H] -> tokens [B, k], each
    row's q [k, V] (None when greedy) and previous tokens [B, k]. The head reads its weights once
    for every row, the Markov head once per slot; each row samples with its own sampler, a key per
    slot (as ``chain_tokens`` does with a Markov head; without one it draws a single key for every
    slot). All lazy."""
    base = model.logits(h)
    to_token = (lambda i: i) if vocab is None else (lambda i: vocab[i])
    rows, slots = h.shape[0], h.shape[1]
    head = getattr(model, "markov_head", None)
    prev = mx.array([int(a) for a in anchors], dtype=mx.uint32)
    state = head.initial_state(h.dtype) if head is not None else None
    if state is not None:
        state = mx.broadcast_to(state, (rows, state.shape[-1]))
    tokens, probs, prevs = [], [[] for _ in range(rows)], []
    for k in range(slots):
        logits = base[:, k]
        if head is not None:
            bias, state = head.step(prev, h[:, k], state)
            logits = logits + bias
        prevs.append(prev)
        prev = to_token(pick_rows(logits, samplers, [True] * rows, probs)).astype(mx.uint32)
        tokens.append(prev)
    qs = [spread_to_vocab(mx.stack(p), vocab, model.cfg.vocab_size) if p else None for p in probs]
    return mx.stack(tokens, axis=1), qs, mx.stack(prevs, axis=1)


def confidences(model: DSparkModel, h: mx.array, prevs: mx.array) -> mx.array:
    """c_k = sigmoid(w·[h_k; W1[x_{k-1}]] + b) per slot [k]."""
    feats = h
    if model.cfg.confidence_head_with_markov:
        feats = mx.concatenate([h, model.markov_head.markov_w1(prevs).astype(h.dtype)], axis=-1)
    return model.confidence_head(feats)


RULES = ("slot", "product")


def _f32(x: float) -> float:
    """``x`` rounded to float32 (a product of two float32 values rounded once, as the device does)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def keep_count(conf: Sequence[float], threshold: float, rule: str = "slot") -> int:
    """How many leading slots a cut keeps: ``slot``: up to the first slot scored below the
    threshold; ``product``: while the running product of scores stays >= the threshold. In
    float32 like ``confident_prefix``, so a calibration's replay cuts where the drafter does."""
    limit, kept, running = _f32(threshold), 0, 1.0
    for c in conf:
        c = _f32(c)
        running = _f32(running * c)
        if (c if rule == "slot" else running) < limit:
            break
        kept += 1
    return kept


def confident_prefix(conf: mx.array, threshold: float, rule: str = "slot") -> int:
    """``keep_count`` on the device: one array expression, one read-back of the count."""
    conf = conf.astype(mx.float32)
    alive = (conf if rule == "slot" else mx.cumprod(conf)) >= threshold
    return int(mx.cumprod(alive.astype(mx.int32)).sum().item())


class DSparkDrafter(BlockDrafter):
    name = "dspark"

    def __init__(self, model: DSparkModel, cfg: BlockConfig, target: "Target", *,
                 confidence_threshold: float | Callable[[], float | None] | None = None,
                 confidence_rule: str | Callable[[], str | None] | None = None):
        """``confidence_threshold`` / ``confidence_rule``: a value, or a callable read at every
        proposal (the engine's setting, so changing it needs no reload). None: the cut this
        machine's calibration picked (``calibrated``, set by the calibrator), else the drafter's
        own (config.json ``tandem.confidence_threshold`` / ``tandem.confidence_rule``), else the
        slot rule without a threshold (no cut); a threshold of 0: no cut."""
        super().__init__(model, cfg, target)
        self._threshold = confidence_threshold if callable(confidence_threshold) else (lambda: confidence_threshold)
        self._rule = confidence_rule if callable(confidence_rule) else (lambda: confidence_rule)
        extra = cfg.raw.get("tandem") if isinstance(cfg.raw.get("tandem"), dict) else {}
        self.default_threshold = extra.get("confidence_threshold")
        if self.default_threshold is not None and (isinstance(self.default_threshold, bool) or not isinstance(
                self.default_threshold, (int, float)) or not 0.0 <= self.default_threshold <= 1.0):
            raise TandemError(f"dspark drafter: config.json tandem.confidence_threshold must be a number in [0, 1], "
                              f"got {self.default_threshold!r}")
        self.default_rule = extra.get("confidence_rule", "slot")
        if self.default_rule not in RULES:
            raise TandemError(f"dspark drafter: config.json tandem.confidence_rule must be one of {', '.join(RULES)}, "
                              f"got {self.default_rule!r}")
        self.calibrated: tuple[str, float] | None = None  # (rule, threshold) this machine's calibration picked
        self.trace: list[list[float]] | None = None  # when a list: record every slot's score, cut nothing
        self.cut()  # validate now
        self.vocab_ids = mx.array(cfg.draft_vocab, dtype=mx.uint32) if cfg.draft_vocab else None

    def cut(self) -> tuple[str, float | None]:
        """(rule, threshold or None for no cut) in force now."""
        threshold, rule = self._threshold(), self._rule()
        if rule is not None and rule not in RULES:
            raise TandemError(f"confidence rule must be one of {', '.join(RULES)}, got '{rule}'")
        if threshold is None and rule is None and self.calibrated is not None:
            rule, threshold = self.calibrated
        if threshold is None:
            threshold = self.default_threshold
        rule = rule or self.default_rule
        if threshold is None:
            return rule, None
        if not 0.0 <= float(threshold) <= 1.0:
            raise TandemError(f"confidence threshold must be in [0, 1], got {threshold}")
        return rule, (float(threshold) if threshold > 0 and self.cfg.confidence_head else None)

    def embed(self, ids: mx.array) -> mx.array:
        return self.model.embed_tokens(ids)

    def propose(self, ids: Sequence[int], cap: int, sampler: Sampler) -> Draft | None:
        cap = min(int(cap), self.max_draft)
        if cap <= 0:
            return None
        h = self.block_states(ids)[:cap]  # the backbone always runs the full block
        tokens, q, prevs = chain_tokens(self.model, h, int(ids[-1]), sampler, self.vocab_ids)
        if self.trace is not None and self.cfg.confidence_head:
            self.trace.append(confidences(self.model, h, prevs).astype(mx.float32).tolist())
            return Draft(tokens, q)
        rule, threshold = self.cut()
        if threshold is not None:
            keep = confident_prefix(confidences(self.model, h, prevs), threshold, rule)
            if keep == 0:
                return None
            tokens, q = tokens[:keep], (None if q is None else q[:keep])
        return Draft(tokens, q)

    @staticmethod
    def propose_rows(requests: Sequence[tuple["DSparkDrafter", Sequence[int], int, Sampler]]) -> list[Draft | None]:
        """``propose`` for several sequences whose drafters share one model (rows of a batch,
        engine/batch.py): one block forward serves every row (each over its own context), then
        the head, the Markov chain and the confidence cut run once over every row. Each row's draft is one
        that ``propose`` could give it alone (the head's sums may differ in the last bits)."""
        if len(requests) == 1 or any(d.trace is not None for d, _, _, _ in requests):
            return [d.propose(ids, cap, s) for d, ids, cap, s in requests]
        first = requests[0][0]
        caps = [min(int(cap), d.max_draft) for d, _, cap, _ in requests]
        width = max(caps)
        h = first.block_states_rows([(d, ids) for d, ids, _, _ in requests])[:, :width]
        tokens, qs, prevs = chain_rows(first.model, h, [int(ids[-1]) for _, ids, _, _ in requests],
                                       [s for _, _, _, s in requests], first.vocab_ids)
        cuts = [d.cut() for d, _, _, _ in requests]
        conf = None
        if any(t is not None for _, t in cuts):
            conf = confidences(first.model, h, prevs).astype(mx.float32).tolist()
        out: list[Draft | None] = []
        for b, ((rule, threshold), cap, q) in enumerate(zip(cuts, caps, qs)):
            keep = cap if threshold is None else keep_count(conf[b][:cap], threshold, rule)
            out.append(Draft(tokens[b, :keep], None if q is None else q[:keep]) if keep > 0 else None)
        return out
