"""The chat's Qt-free parts: the conversation store (SQLite) and its exports, and the Markdown
renderer's HTML."""

from __future__ import annotations

import json
import sqlite3

import pytest

from app import markdown_render as md
from app.conversations import (SCHEMA_VERSION, Conversation, ConversationStore, Message, title_from, to_json,
                               to_markdown)
from engine.errors import TandemError


def turn(q: str, a: str, **stats) -> list[Message]:
    return [Message("user", q), Message("assistant", a, stats or None)]


# -- conversation store -------------------------------------------------------------------------------
def test_conversation_store_round_trip_and_restart(tmp_path):
    path = tmp_path / "deep" / "history.sqlite3"  # folders are made as needed
    store = ConversationStore(path)
    a = store.create("", "Be brief.", {"mode": "lookup", "temperature": 0.7})
    store.replace_from(a.id, 0, turn("first question", "first answer", tokens=3, mode="lookup"))
    store.replace_from(a.id, 2, turn("second", "answer two"))
    b = store.create("Other chat")
    store.rename(a.id, "  Renamed  ")
    store.update(b.id, system_prompt="You are a pirate.", settings={"top_k": 40})
    store.close()

    store = ConversationStore(path)  # a restart
    assert store.schema_version == SCHEMA_VERSION
    got = store.load(a.id)
    assert got.title == "Renamed" and got.system_prompt == "Be brief."
    assert got.settings == {"mode": "lookup", "temperature": 0.7}
    assert [(m.role, m.content) for m in got.messages] == [("user", "first question"), ("assistant", "first answer"),
                                                           ("user", "second"), ("assistant", "answer two")]
    assert got.messages[1].stats == {"tokens": 3, "mode": "lookup"} and got.messages[3].stats is None
    assert got.chat_messages() == [{"role": "system", "content": "Be brief."}] + [
        {"role": m.role, "content": m.content} for m in got.messages]
    assert got.chat_messages(1) == [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "first question"}]
    other = store.load(b.id)
    assert other.system_prompt == "You are a pirate." and other.settings == {"top_k": 40} and other.messages == []
    store.replace_from(b.id, 0, turn("q", "a"))  # the chat answered last comes first
    assert [c.id for c in store.list()][0] == b.id
    assert store.load(12345) is None


def test_conversation_store_replace_drops_later_turns(tmp_path):
    store = ConversationStore(tmp_path / "h.sqlite3")
    c = store.create()
    for i in range(3):
        store.replace_from(c.id, 2 * i, turn(f"q{i}", f"a{i}"))
    store.replace_from(c.id, 2, turn("q1 edited", "new a1"))  # edit the second question
    assert [m.content for m in store.load(c.id).messages] == ["q0", "a0", "q1 edited", "new a1"]
    store.replace_from(c.id, 2, turn("q1 edited", "regenerated"))  # regenerate the last answer
    assert [m.content for m in store.load(c.id).messages] == ["q0", "a0", "q1 edited", "regenerated"]
    store.delete(c.id)
    assert store.load(c.id) is None
    assert store.db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0  # cascaded
    with pytest.raises(TandemError, match="no longer exists"):
        store.replace_from(c.id, 0, turn("late", "answer"))


def test_conversation_store_failed_write_keeps_the_old_turns(tmp_path):
    """replace_from is one transaction: a write that fails half-way leaves the file as it was."""
    store = ConversationStore(tmp_path / "h.sqlite3")
    c = store.create()
    store.replace_from(c.id, 0, turn("q0", "a0") + turn("q1", "a1"))
    with pytest.raises(sqlite3.IntegrityError):
        store.replace_from(c.id, 2, [Message("user", "edited"), Message("robot", "bad role")])
    assert [m.content for m in store.load(c.id).messages] == ["q0", "a0", "q1", "a1"]


def test_conversation_store_search(tmp_path):
    store = ConversationStore(tmp_path / "h.sqlite3")
    a = store.create("Sourdough starter")
    b = store.create("Rust lifetimes")
    store.replace_from(b.id, 0, turn("what does 'a mean?", "a lifetime parameter, 100% static_ok"))
    assert [c.id for c in store.list("sourdough")] == [a.id]  # title, any case
    assert [c.id for c in store.list("LIFETIME PARAMETER")] == [b.id]  # message text
    assert [c.id for c in store.list("100%")] == [b.id]  # LIKE wildcards are literal
    assert store.list("100%x") == [] and store.list("static_") and not store.list("static_x")
    assert {c.id for c in store.list("  ")} == {a.id, b.id}


def test_conversation_store_schema_versioning(tmp_path):
    path = tmp_path / "h.sqlite3"
    ConversationStore(path).close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.commit()
    db.close()
    with pytest.raises(TandemError, match="newer Tandem"):
        ConversationStore(path)
    junk = tmp_path / "junk.sqlite3"
    junk.write_bytes(b"this is not a database" * 100)
    with pytest.raises(TandemError, match="unreadable"):
        ConversationStore(junk)


def test_conversation_titles():
    assert title_from("  How do I\n reverse a list?") == "How do I"
    long = "word " * 30
    t = title_from(long)
    assert t.endswith("…") and len(t) <= 61 and not t[:-1].endswith(" ")
    assert title_from("") == "" and Conversation(None).display_title == "New chat"


def test_conversation_export_markdown_and_json():
    conv = Conversation(7, "Sorting", 1.0, 2.0, "Answer in Python.", {"mode": "auto"},
                        turn("How do I sort?", "Use `sorted()`:\n\n```python\nsorted(xs)\n```", tokens=9,
                             decode_tps=41.5, mode="lookup"))
    text = to_markdown(conv)
    assert text.startswith("# Sorting\n") and "> Answer in Python." in text
    assert "## You\n\nHow do I sort?" in text and "```python\nsorted(xs)\n```" in text
    assert "*9 tokens · 41.5 tok/s · mode lookup*" in text
    doc = json.loads(to_json(conv))
    assert doc["format"] == "tandem-conversation" and doc["title"] == "Sorting"
    assert doc["system_prompt"] == "Answer in Python." and doc["settings"] == {"mode": "auto"}
    assert doc["messages"][0] == {"role": "user", "content": "How do I sort?"}
    assert doc["messages"][1]["stats"]["tokens"] == 9


# -- markdown ----------------------------------------------------------------------------------------------
def test_markdown_code_fence_is_highlighted_with_a_copy_link():
    r = md.render("Try:\n\n```python\ndef f(x):\n    return x < 2\n```\nand `inline`.")
    assert r.code_blocks == ["def f(x):\n    return x < 2"]
    assert "```" not in r.html and "href='copy:0'" in r.html
    assert "<span style=" in r.html and "&lt;</span>" in r.html and " < " not in r.html  # Pygments spans, escaped
    assert "<code style='background-color:" in r.html  # inline code
    dark = md.render("```python\ndef f(): pass\n```", md.DARK)
    assert md.DARK["code_bg"] in dark.html and md.LIGHT["code_bg"] not in dark.html


def test_markdown_unknown_language_and_unclosed_fence_while_streaming():
    r = md.render("```nosuchlang\nx = 1\n```\n```\nplain\n")  # the second fence is still streaming
    assert r.code_blocks == ["x = 1", "plain"]
    assert "nosuchlang" in r.html and "```" not in r.html


def test_markdown_tables_lists_and_escaped_html():
    r = md.render("| a | b |\n|:--|--:|\n| 1 | 2 |\n\n- one\n- two\n\n"
                  "<script>alert(1)</script> [x](javascript:alert(1))")
    assert "<table" in r.html and "<th" in r.html and "align='right'" in r.html
    assert "<li>one</li>" in r.html
    assert "<script>" not in r.html and "&lt;script&gt;" in r.html
    assert "href='javascript" not in r.html  # markdown-it refuses the link


def test_markdown_think_blocks_fold():
    segs = md.split_think("<think>step one</think>The answer.")
    assert [(s.kind, s.text, s.closed) for s in segs] == [("think", "step one", True), ("text", "The answer.", True)]
    assert [(s.kind, s.closed) for s in md.split_think("<think>still going")] == [("think", False)]
    # the template opened <think> itself: the output starts inside the reasoning
    assert [s.kind for s in md.split_think("hmm</think>Done")] == ["think", "text"]
    assert [s.kind for s in md.split_think("Plain </think> text")] == ["think", "text"]
    assert [s.kind for s in md.split_think("<think>a</think>b </think> c")] == ["think", "text"]  # stray: text
    folded = md.render("<think>secret reasoning</think>The answer.")
    assert "secret reasoning" not in folded.html and "href='think:0'" in folded.html
    assert "Reasoning · 2 words" in folded.html
    assert "secret reasoning" in md.render("<think>secret reasoning</think>x", expanded={0}).html
    assert "Thinking…" in md.render("<think>partial").html
    assert md.plain_text("<think>hidden</think>\nShown **text**") == "Shown **text**"
