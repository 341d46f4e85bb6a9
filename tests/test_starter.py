"""The real starter model through the engine: coherent chat, lossless lookup on a copy-heavy
prompt, and the CLI's one-line errors."""

from __future__ import annotations

import struct

import pytest

from engine.cli import main
from tests.lossless import assert_same_greedy

CODE = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
    a, b = 0, 1
    for _ in range(n - 1):
        a, b = b, a + b
    return b


def word_count(text):
    """Count how often each word occurs in text."""
    counts = {}
    for word in text.split():
        word = word.lower()
        counts[word] = counts.get(word, 0) + 1
    return counts'''


def test_chat_answer_is_coherent(starter_engine):
    res = starter_engine.generate("What is the capital of France? Answer in one sentence.", mode="baseline",
                                  max_new_tokens=24)
    assert "Paris" in res.text
    assert res.finish_reason == "stop"  # it ends its answer with <|im_end|>
    assert res.target_forwards >= res.generated


def test_lookup_on_copy_prompt_is_identical_and_needs_fewer_forwards(starter_engine):
    prompt = "Repeat this code exactly, without any changes:\n\n" + CODE
    base = starter_engine.generate(prompt, mode="baseline", max_new_tokens=96)
    look = starter_engine.generate(prompt, mode="lookup", max_new_tokens=96)
    ids = starter_engine.encode(prompt)
    assert_same_greedy(starter_engine.model, ids, base.token_ids, look.token_ids, "starter/lookup")
    assert look.mean_accepted > 1.5
    assert look.target_forwards < base.target_forwards


def _one_line_error(capsys, argv, pattern):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc != 0
    assert len(err.splitlines()) == 1 and err.startswith("tandem: error:"), err
    assert pattern in err, err
    return err


def test_cli_bad_input_gives_one_line_errors(capsys, tmp_path):
    _one_line_error(capsys, ["generate", "--prompt", "  "], "empty prompt")
    _one_line_error(capsys, ["generate", "--prompt", "hi", "--max-new-tokens", "0"], "max-new-tokens")
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_error(capsys, ["generate", "--model", str(empty), "--prompt", "hi"], "config.json")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + struct.pack("<I", 3) + b"\x00" * 10)
    _one_line_error(capsys, ["generate", "--model", str(bad), "--prompt", "hi"], "bad.gguf")
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text('{"model_type": "no-such-arch"}')
    import mlx.core as mx

    mx.save_safetensors(str(unknown / "model.safetensors"), {"w": mx.zeros((2, 2))})
    _one_line_error(capsys, ["generate", "--model", str(unknown), "--prompt", "hi"], "no-such-arch")


@pytest.mark.parametrize("mode", ["baseline", "lookup"])
def test_cli_generate_streams_and_summarises(capsys, mode):
    rc = main(["generate", "--mode", mode, "--prompt", "Say hello.", "--max-new-tokens", "8"])
    out = capsys.readouterr()
    assert rc == 0
    assert out.out.strip()
    assert f"mode {mode}" in out.err and "tok/s" in out.err and "target forwards" in out.err
