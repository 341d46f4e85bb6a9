"""Streaming detokenization never emits broken UTF-8; stop strings are held back and cut."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine.detokenize import StopMatcher, StreamingDetokenizer


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges: every UTF-8 byte is its own token, so multi-byte
    characters are always split across tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_stream_never_emits_replacement_characters():
    tok = byte_tokenizer()
    text = "héllo 😀 wörld 中文 ok"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # the multi-byte characters really are split
    detok = StreamingDetokenizer(tok)
    pieces = [detok.add([t]) for t in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    # several tokens at once (a speculative block) behave the same
    detok = StreamingDetokenizer(tok)
    pieces = [detok.add(ids[i : i + 3]) for i in range(0, len(ids), 3)] + [detok.flush()]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


def test_stop_matcher_holds_back_partial_stop_and_cuts():
    m = StopMatcher(["</end>"])
    out, stopped = m.feed("abc</e")
    assert out == "abc" and not stopped
    out, stopped = m.feed("nd> tail")
    assert out == "" and stopped
    m = StopMatcher(["</end>"])
    out, stopped = m.feed("abc</x")
    assert out == "abc</x" and not stopped
    m = StopMatcher(["STOP", "ST"])
    out, stopped = m.feed("aSTOPb")
    assert out == "a" and stopped
    m = StopMatcher([])
    assert m.feed("anything") == ("anything", False)
