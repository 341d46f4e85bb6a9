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
distribution the request's penalties and bias define, the same numbers whatever the sampling
settings (greedy and sampled requests report alike; a token outside the nucleus keeps a finite
logprob). Why: OpenAI's logprobs do not move with ``temperature``, and the brief of the API is
"how likely was this token": a banned (-100) token must read as improbable. vLLM reports the raw
model's logprobs by default (before penalties too) and offers processed ones (after temperature)
as an option; ours sit between, at the distribution the request chose before the sampler's
shaping. The chosen token's logprob comes with the ``top`` most likely tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import mlx.core as mx
import numpy as np

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
    """One generation's processing. ``rows`` is a function of (logits, the history of each row).
    Between calls it keeps the committed ids' counts (dense on the device, updated by the new
    tokens only) and the distinct tokens that have a count or a bias (on the host): only those
    columns can change, so a call costs O(rows x those) besides one float32 copy of the rows."""

    def __init__(self, processing: Processing, prompt_ids: Sequence[int]):
        self.processing = processing
        self._prompt_len = len(prompt_ids)
        self._counted = 0  # ids folded into the counts below
        self._output: mx.array | None = None  # [V] count of each token in the output so far
        self._seen: mx.array | None = None  # [V] count of each token in prompt + output
        self._bias: mx.array | None = None  # [V]
        self._vocab: int | None = None  # known at the first call
        self._prompt = list(prompt_ids)  # until the first call
        self._columns: dict[int, None] = {}  # tokens with a count or a bias, in first-seen order
        self._columns_array: mx.array | None = None

    def _setup(self, vocab: int) -> None:
        self._vocab = vocab
        p = self.processing
        if p.presence_penalty or p.frequency_penalty:
            self._output = mx.zeros((vocab,), dtype=mx.float32)
        if p.repetition_penalty != 1.0:
            self._seen = _add_counts(mx.zeros((vocab,), dtype=mx.float32), self._prompt)
            self._add_columns(self._prompt)
        if p.logit_bias:
            ids = mx.array(list(p.logit_bias), dtype=mx.int32)
            self._bias = mx.zeros((vocab,), dtype=mx.float32).at[ids].add(mx.array(list(p.logit_bias.values()),
                                                                                     dtype=mx.float32))
            self._add_columns(p.logit_bias)
        self._counted = self._prompt_len
        self._prompt = []

    def _add_columns(self, tokens: Iterable[int]) -> None:
        before = len(self._columns)
        self._columns.update(dict.fromkeys(int(t) for t in tokens))
        if len(self._columns) != before:
            self._columns_array = None

    def _catch_up(self, ids: Sequence[int]) -> None:
        new = ids[self._counted:]
        if not new:
            return
        if self._output is not None:
            self._output = _add_counts(self._output, new)
        if self._seen is not None:
            self._seen = _add_counts(self._seen, new)
        if self._output is not None or self._seen is not None:
            self._add_columns(new)
        self._counted = len(ids)

    def rows(self, logits: mx.array, ids: Sequence[int], tail: mx.array | None = None) -> mx.array:
        """Processed logits for ``logits`` [R, V] (or [V]). Row i's history is ``ids`` (committed:
        prompt + output) followed by ``tail[: len(tail) - R + 1 + i]``: for a verify, ``tail`` is
        the drafts (row i sees the first i); for a plain step in flight, the one token not yet in
        ``ids``. Lazy; float32."""
        p = self.processing
        if not p.changes_logits:
            return logits
        single = logits.ndim == 1
        x = (logits[None] if single else logits).astype(mx.float32)
        if self._vocab is None:
            self._setup(x.shape[-1])
        self._catch_up(ids)
        if self._columns_array is None:
            self._columns_array = mx.array(list(self._columns), dtype=mx.int32)
        columns = self._columns_array
        rows = x.shape[0]
        tail = None if tail is None or not tail.size else tail.reshape(-1).astype(mx.int32)
        counting = self._output is not None or self._seen is not None
        if tail is not None and counting:
            columns = mx.concatenate([columns, tail])  # a draft seen twice: the same value written twice
        if not columns.size:
            return x[0] if single else x
        wide = mx.broadcast_to(columns[None], (rows, columns.size))
        values = mx.take_along_axis(x, wide, axis=-1)
        output = None if self._output is None else self._output[columns]
        seen = None if self._seen is None else self._seen[columns]
        if tail is not None and counting:
            lead = tail.size - (rows - 1)  # tail tokens every row sees
            if lead < 0:
                raise ValueError(f"{rows} rows need at least {rows - 1} tail tokens, got {tail.size}")
            onehot = (tail[:, None] == columns[None]).astype(mx.float32)
            extra = mx.concatenate([mx.zeros((1, columns.size)), mx.cumsum(onehot, axis=0)])[lead:]  # row i: tail[:lead + i]
            output = None if output is None else output + extra
            seen = None if seen is None else seen + extra
        if self._bias is not None:
            values = values + self._bias[columns]
        if seen is not None:
            r = p.repetition_penalty
            values = mx.where(seen > 0, mx.where(values > 0, values / r, values * r), values)
        if output is not None:
            if p.frequency_penalty:
                values = values - p.frequency_penalty * output
            if p.presence_penalty:
                values = values - p.presence_penalty * (output > 0)
        x = mx.put_along_axis(x, wide, values, axis=-1)
        return x[0] if single else x

    @property
    def wants_logprobs(self) -> bool:
        return self.processing.logprobs is not None

    def logprobs(self, rows: mx.array, tokens: Sequence[int]) -> list[TokenLogprob] | None:
        """``TokenLogprob`` of each of ``tokens`` under the processed ``rows`` [n, V] (row i chose
        token i); None when the request wants none. On the host (NumPy): read back once, the
        log-softmax and a threshold top-k there cost a quarter of MLX's CPU logsumexp and
        argpartition over a 50k-150k vocabulary."""
        if self.processing.logprobs is None:
            return None
        x = np.asarray(rows.astype(mx.float32)).reshape(len(tokens), -1)
        peak = x.max(axis=-1)
        lse = peak + np.log(np.exp(x - peak[:, None]).sum(axis=-1))
        out = []
        for i, token in enumerate(tokens):
            top = _top_ids(x[i], peak[i], self.processing.logprobs)
            out.append(TokenLogprob(int(token), float(x[i, token] - lse[i]),
                                    [(int(j), float(x[i, j] - lse[i])) for j in top]))
        return out


def _top_ids(row: np.ndarray, peak: float, k: int) -> np.ndarray:
    """The ``k`` largest entries' indices, largest first: among those within a margin of the
    peak (widened until k qualify), so a sharp distribution never partitions the vocabulary."""
    k = min(k, row.size)
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    margin = 8.0
    while True:
        ids = np.flatnonzero(row > peak - margin) if np.isfinite(margin) else np.arange(row.size)
        if ids.size >= k:
            break
        margin = margin * 4 if margin < 1e6 else np.inf
    if ids.size > k:
        ids = ids[np.argpartition(-row[ids], k - 1)[:k]]
    return ids[np.argsort(-row[ids], kind="stable")]


def _add_counts(counts: mx.array, tokens: Sequence[int]) -> mx.array:
    if not len(tokens):
        return counts
    return counts.at[mx.array(list(tokens), dtype=mx.int32)].add(1.0)
