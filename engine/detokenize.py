"""Streaming detokenization and stop strings.

Byte-level BPE splits multi-byte characters (emoji, CJK) across tokens; decoding a prefix then
ends in U+FFFD. The detokenizer re-decodes a short window of recent tokens and only releases text
once it no longer ends in a replacement character, so a stream never emits broken UTF-8, and the
concatenation of the stream equals decoding all tokens at once.
"""

from __future__ import annotations

from typing import Any, Sequence


class StreamingDetokenizer:
    def __init__(self, tokenizer: Any):
        self._tok = tokenizer
        self.tokens: list[int] = []
        self._prefix = 0  # window start: tokens before it are final text
        self._read = 0  # tokens up to here have been released as text
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def add(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly complete text (maybe empty)."""
        self.tokens.extend(int(t) for t in token_ids)
        before = self._decode(self.tokens[self._prefix : self._read])
        after = self._decode(self.tokens[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            new = after[len(before) :]
            self._prefix, self._read = self._read, len(self.tokens)
            self.text += new
            return new
        return ""

    def flush(self) -> str:
        """At the end of generation: release whatever is left, even an incomplete character."""
        before = self._decode(self.tokens[self._prefix : self._read])
        after = self._decode(self.tokens[self._prefix :])
        new = after[len(before) :] if after.startswith(before) else ""
        self._prefix = self._read = len(self.tokens)
        self.text += new
        return new


class StopMatcher:
    """Finds stop strings in streamed text and holds back any tail that could start one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped)."""
        if not self.stops:
            return text, False
        buf = self._held + text
        hits = [(buf.find(s), s) for s in self.stops if s in buf]
        if hits:
            pos = min(h[0] for h in hits)
            self._held = ""
            return buf[:pos], True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
