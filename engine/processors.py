"""Per-request logit processors (penalties, ``logit_bias``) and logprobs, for every verify row.

A request's ``Processing`` says what it asks for; its ``LogitsProcessor`` (one per generation,
carried by the request's ``Sampler``) turns target logits into the logits the request samples
from. The loop calls it in one place per verify and per plain step with the rows' history: the
committed ids (prompt + output, ending with the anchor) and the drafts before each row. A
processor that reads only the tokens before a position gives each verify row exactly the logits
plain decoding computes there, so greedy output stays identical and speculative sampling stays
an exact sample of the processed target distribution. Drafters still propose from their own,
unprocessed distributions: the speculative-sampling rule is exact for any proposal q, so only
the acceptance rate depends on it.

Definitions (vLLM's, which follow OpenAI's API; applied in this order):

* ``logit_bias``: {token id: bias} added to the logits (-100 bans a token in practice).
* ``repetition_penalty`` r (CTRL, Keskar et al. 2019): for every token seen in the prompt or the
  output so far, a positive logit is divided by r and a negative one multiplied by r. 1 = off.
* ``frequency_penalty`` f: minus f times the token's count in the output so far.
* ``presence_penalty`` p: minus p for every token that occurs in the output so far.

mlx-lm's processors use the same formulas over the last 20 tokens of prompt + output instead.

Logprobs are the log-softmax of the processed logits, before temperature and top-k/top-p: the
distribution the request's penalties and bias define, the same number whatever the sampling
settings. That is OpenAI's convention (a token's logprob does not move with ``temperature``) and
vLLM's default (its logprobs ignore temperature and truncation); a token outside the nucleus
keeps a finite logprob. The chosen token's logprob comes with the ``top`` most likely tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import mlx.core as mx

from engine.errors import TandemError

MAX_TOP_LOGPROBS = 20
MAX_BIAS = 100.0


@dataclass(frozen=True)
class Processing:
    """What one request asks of the logits. ``logprobs``: None = none, else how many top
    alternatives to report with each token (0: the chosen token's logprob alone)."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    logprobs: int | None = None

    @property
    def changes_logits(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

    @property
    def active(self) -> bool:
        return self.changes_logits or self.logprobs is not None

    def validate(self, vocab: int | None = None) -> "Processing":
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise TandemError(f"{name.replace('_', '-')} must be between -2 and 2, got {value}")
        r = self.repetition_penalty
        if not (math.isfinite(r) and r > 0):
            raise TandemError(f"repetition-penalty must be a number above 0 (1 = off), got {r}")
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0 or (vocab and token >= vocab):
                raise TandemError(f"logit-bias: token id {token!r} is not in the vocabulary"
                                  + (f" (0..{vocab - 1})" if vocab else ""))
            if not (math.isfinite(bias) and -MAX_BIAS <= bias <= MAX_BIAS):
                raise TandemError(f"logit-bias for token {token} must be between -100 and 100, got {bias}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise TandemError(f"top logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.logprobs}")
        return self


def parse_logit_bias(text: str) -> dict[int, float]:
    """``"12:-100,7:2.5"`` (the CLI's form) -> {12: -100.0, 7: 2.5}."""
    out: dict[int, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        token, sep, bias = part.partition(":")
        try:
            out[int(token)] = float(bias)
        except ValueError:
            raise TandemError(f"logit-bias: '{part}' is not TOKEN_ID:BIAS (e.g. 12:-100)") from None
        if not sep:
            raise TandemError(f"logit-bias: '{part}' is not TOKEN_ID:BIAS (e.g. 12:-100)")
    return out


@dataclass
class TokenLogprob:
    """One committed token: its logprob and the ``top`` alternatives (id, logprob), best first."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class LogitsProcessor:
    """One generation's processing. ``rows`` is a function of (logits, the history of each row);
    it keeps device-side counts of the committed ids between calls so a step costs O(new tokens)."""

    def __init__(self, processing: Processing, prompt_ids: Sequence[int]):
        self.processing = processing
        self._prompt_len = len(prompt_ids)
        self._counted = 0  # ids folded into the counts below
        self._output: mx.array | None = None  # [V] count of each token in the output so far
        self._seen: mx.array | None = None  # [V] count of each token in prompt + output
        self._bias: mx.array | None = None
        self._vocab: int | None = None  # known at the first call
        self._prompt = list(prompt_ids)

    @property
    def wants_logprobs(self) -> bool:
        return self.processing.logprobs is not None

    def _setup(self, vocab: int) -> None:
        self._vocab = vocab
        p = self.processing
        if p.presence_penalty or p.frequency_penalty:
            self._output = mx.zeros((vocab,), dtype=mx.float32)
        if p.repetition_penalty != 1.0:
            self._seen = _add_counts(mx.zeros((vocab,), dtype=mx.float32), self._prompt)
        if p.logit_bias:
            ids = mx.array(list(p.logit_bias), dtype=mx.int32)
            self._bias = mx.zeros((vocab,), dtype=mx.float32).at[ids].add(mx.array(list(p.logit_bias.values()),
                                                                                     dtype=mx.float32))
        self._counted = self._prompt_len

    def _catch_up(self, ids: Sequence[int]) -> None:
        new = ids[self._counted:]
        if not new:
            return
        if self._output is not None:
            self._output = _add_counts(self._output, new)
        if self._seen is not None:
            self._seen = _add_counts(self._seen, new)
        self._counted = len(ids)

    def rows(self, logits: mx.array, ids: Sequence[int], tail: mx.array | None = None) -> mx.array:
        """Processed logits for ``logits`` [R, V] (or [V]). Row i's history is ``ids`` (committed:
        prompt + output) followed by ``tail[: len(tail) - R + 1 + i]``: for a verify, ``tail`` is
        the drafts (row i sees the first i); for a plain step in flight, the one token not yet in
        ``ids``. Lazy; float32."""
        if not self.processing.changes_logits:
            return logits
        single = logits.ndim == 1
        x = (logits[None] if single else logits).astype(mx.float32)
        if self._vocab is None:
            self._setup(x.shape[-1])
        self._catch_up(ids)
        output, seen = self._output, self._seen
        rows = x.shape[0]
        if tail is not None and tail.size:
            tail = tail.reshape(-1).astype(mx.int32)
            lead = tail.size - (rows - 1)  # tail tokens every row sees
            if lead < 0:
                raise ValueError(f"{rows} rows need at least {rows - 1} tail tokens, got {tail.size}")
            row, col = _before_each_row(rows, lead)  # row i sees tail[:lead + i]
            extra = mx.zeros((rows, x.shape[-1]), dtype=mx.float32).at[mx.array(row), tail[mx.array(col)]].add(1.0)
            output = None if output is None else output + extra
            seen = None if seen is None else seen + extra
        p = self.processing
        if self._bias is not None:
            x = x + self._bias
        if seen is not None:
            r = p.repetition_penalty
            x = mx.where(seen > 0, mx.where(x > 0, x / r, x * r), x)
        if output is not None:
            if p.frequency_penalty:
                x = x - p.frequency_penalty * output
            if p.presence_penalty:
                x = x - p.presence_penalty * (output > 0)
        return x[0] if single else x

    def logprobs(self, rows: mx.array, tokens: mx.array) -> tuple[mx.array, ...] | None:
        """Lazy (chosen logprob [n], top ids [n, k], top logprobs [n, k]) of ``tokens`` [n] under
        the processed ``rows`` [n, V] (row i chose token i); None when the request wants none.
        Read them back with ``read_logprobs``."""
        if self.processing.logprobs is None:
            return None
        rows = rows.reshape(-1, rows.shape[-1]).astype(mx.float32)
        tokens = tokens.reshape(-1).astype(mx.int32)
        lp = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
        k = min(self.processing.logprobs, lp.shape[-1])
        if k == 0:
            return (chosen,)
        top_ids = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
        top_lp = mx.take_along_axis(lp, top_ids, axis=-1)
        order = mx.argsort(-top_lp, axis=-1)
        return chosen, mx.take_along_axis(top_ids, order, axis=-1), mx.take_along_axis(top_lp, order, axis=-1)


def read_logprobs(tokens: Sequence[int], parts: tuple[mx.array, ...] | None) -> list[TokenLogprob] | None:
    """Host-side ``TokenLogprob`` per token from ``LogitsProcessor.logprobs``'s arrays."""
    if parts is None:
        return None
    chosen = parts[0].tolist()
    if len(parts) == 1:
        return [TokenLogprob(int(t), float(c)) for t, c in zip(tokens, chosen)]
    ids, lps = parts[1].tolist(), parts[2].tolist()
    return [TokenLogprob(int(t), float(c), list(zip(map(int, i), map(float, v))))
            for t, c, i, v in zip(tokens, chosen, ids, lps)]


def _before_each_row(rows: int, lead: int) -> tuple[list[int], list[int]]:
    """(row, tail index) pairs: row i sees tail[: lead + i]."""
    pairs = [(i, j) for i in range(rows) for j in range(lead + i)]
    return [i for i, _ in pairs], [j for _, j in pairs]


def _add_counts(counts: mx.array, tokens: Sequence[int]) -> mx.array:
    if not len(tokens):
        return counts
    return counts.at[mx.array(list(tokens), dtype=mx.int32)].add(1.0)
