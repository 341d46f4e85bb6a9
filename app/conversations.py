"""Chat history on disk: conversations and their messages in one SQLite file (stdlib ``sqlite3``).

No Qt here, so the store is testable on its own. The app opens it in its app-data folder
(``app.settings.history_path``). A turn (the user's message and the answer) is written in one
transaction when the answer completes, and an edit or a regenerate replaces the later turns in
that same transaction: a crash loses at most the turn in flight, never an older one.

The schema is versioned with ``PRAGMA user_version``; ``MIGRATIONS[i]`` takes a file from
version i to i + 1, so an old file is upgraded in place and a newer one is refused in one line.

Images attached to a message are stored once by content hash (``images``: the file's bytes, at
most ``engine.images.MAX_IMAGE_BYTES`` each) and referenced by position (``message_images``); an
image no message references any more is dropped with the turn or conversation that held it.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from engine.errors import TandemError
from engine.images import MAX_IMAGE_BYTES

FORMAT = "tandem-conversation"
MIGRATIONS = (
    """
    CREATE TABLE conversations (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        title TEXT NOT NULL DEFAULT '',
        created REAL NOT NULL,
        updated REAL NOT NULL,
        system_prompt TEXT NOT NULL DEFAULT '',
        settings TEXT NOT NULL DEFAULT '{}'
    );
    CREATE TABLE messages (
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        position INTEGER NOT NULL,
        role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
        content TEXT NOT NULL,
        stats TEXT,
        created REAL NOT NULL,
        PRIMARY KEY (conversation_id, position)
    );
    CREATE INDEX conversations_by_update ON conversations(updated DESC);
    """,
    """
    CREATE TABLE images (
        sha256 TEXT PRIMARY KEY,
        data BLOB NOT NULL,
        created REAL NOT NULL
    );
    CREATE TABLE message_images (
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        position INTEGER NOT NULL,
        slot INTEGER NOT NULL,
        sha256 TEXT NOT NULL REFERENCES images(sha256),
        PRIMARY KEY (conversation_id, position, slot)
    );
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)
TITLE_CHARS = 60


@dataclass
class Message:
    role: str  # "user" or "assistant" (the system prompt belongs to the conversation)
    content: str
    stats: Optional[dict] = None  # an answer's numbers: tokens, tok/s, TTFT, mode, ...
    images: list[bytes] = field(default_factory=list)  # attached image files (a user message's), in order


@dataclass
class Conversation:
    id: Optional[int]  # None until its first turn is stored
    title: str = ""
    created: float = 0.0
    updated: float = 0.0
    system_prompt: str = ""
    settings: dict = field(default_factory=dict)  # mode, temperature, top_p, top_k, max_tokens, seed, thinking
    messages: list[Message] = field(default_factory=list)

    @property
    def display_title(self) -> str:
        return self.title or "New chat"

    def chat_messages(self, upto: Optional[int] = None) -> list[dict]:
        """The history as ``[{"role", "content"}]`` for ``Engine.stream``: the system prompt
        first (when set), then the first ``upto`` messages (all by default); a message with images
        has content parts, its images first (``engine.images.Image``)."""
        out = [{"role": "system", "content": self.system_prompt}] if self.system_prompt.strip() else []
        return out + [chat_message(m) for m in self.messages[:upto]]

    def has_images(self, upto: Optional[int] = None) -> bool:
        return any(m.images for m in self.messages[:upto])


def chat_message(m: Message) -> dict:
    """One message for ``Engine.stream`` (its images decoded; a stored image is trusted no more
    than a new one: the same checks apply)."""
    if not m.images:
        return {"role": m.role, "content": m.content}
    from engine.images import decode_image

    parts = [{"type": "image", "image": decode_image(data, label=f"image {i + 1}")} for i, data in enumerate(m.images)]
    return {"role": m.role, "content": parts + [{"type": "text", "text": m.content}]}


def image_key(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def title_from(text: str) -> str:
    """A title from a first message: its first line, whitespace collapsed, cut at a word."""
    line = " ".join(text.strip().splitlines()[0].split()) if text.strip() else ""
    if len(line) <= TITLE_CHARS:
        return line
    cut = line[:TITLE_CHARS].rsplit(" ", 1)[0] or line[:TITLE_CHARS]
    return cut.rstrip(" ,.;:") + "…"


class ConversationStore:
    """All conversations in one SQLite file (``":memory:"`` for a throwaway store). One thread."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(self.path, timeout=5.0)
            self.db.execute("PRAGMA foreign_keys = ON")
            if self.path != ":memory:":
                self.db.execute("PRAGMA journal_mode = WAL")  # readers never block the writer
            self._migrate()
        except sqlite3.DatabaseError as err:
            raise TandemError(f"chat history {self.path} is unreadable: {err}") from err

    def _migrate(self) -> None:
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise TandemError(f"chat history {self.path} was written by a newer Tandem (schema {version}, "
                              f"this one reads up to {SCHEMA_VERSION})")
        for i in range(version, SCHEMA_VERSION):  # each step in one transaction: all of it or none
            self.db.executescript(f"BEGIN; {MIGRATIONS[i]} PRAGMA user_version = {i + 1}; COMMIT;")

    def close(self) -> None:
        self.db.close()

    @property
    def schema_version(self) -> int:
        return self.db.execute("PRAGMA user_version").fetchone()[0]

    # -- conversations ---------------------------------------------------------------------------
    def create(self, title: str = "", system_prompt: str = "", settings: Optional[dict] = None) -> Conversation:
        now = time.time()
        with self.db:
            cur = self.db.execute(
                "INSERT INTO conversations (title, created, updated, system_prompt, settings) VALUES (?, ?, ?, ?, ?)",
                (title, now, now, system_prompt, json.dumps(settings or {})))
        return Conversation(cur.lastrowid, title, now, now, system_prompt, dict(settings or {}))

    def list(self, query: str = "") -> list[Conversation]:
        """Conversations (without messages), the most recently updated first; ``query`` keeps
        those whose title or any message contains it (case-insensitive)."""
        sql = "SELECT id, title, created, updated, system_prompt, settings FROM conversations"
        args: tuple = ()
        if query.strip():
            pattern = "%" + query.strip().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            sql += (" WHERE title LIKE ?1 ESCAPE '\\' OR id IN (SELECT conversation_id FROM messages"
                    " WHERE content LIKE ?1 ESCAPE '\\')")
            args = (pattern,)
        rows = self.db.execute(sql + " ORDER BY updated DESC, id DESC", args).fetchall()
        return [_conversation(row) for row in rows]

    def load(self, conversation_id: int) -> Optional[Conversation]:
        row = self.db.execute("SELECT id, title, created, updated, system_prompt, settings FROM conversations "
                              "WHERE id = ?", (conversation_id,)).fetchone()
        if row is None:
            return None
        conv = _conversation(row)
        conv.messages = [Message(role, content, json.loads(stats) if stats else None) for role, content, stats in
                         self.db.execute("SELECT role, content, stats FROM messages WHERE conversation_id = ? "
                                         "ORDER BY position", (conversation_id,))]
        for position, data in self.db.execute(
                "SELECT m.position, i.data FROM message_images m JOIN images i ON i.sha256 = m.sha256 "
                "WHERE m.conversation_id = ? ORDER BY m.position, m.slot", (conversation_id,)):
            if position < len(conv.messages):
                conv.messages[position].images.append(bytes(data))
        return conv

    def rename(self, conversation_id: int, title: str) -> None:
        with self.db:
            self.db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title.strip(), conversation_id))

    def update(self, conversation_id: int, *, system_prompt: Optional[str] = None,
               settings: Optional[dict] = None) -> None:
        """Save a conversation's system prompt and/or sampling settings (its order is kept)."""
        with self.db:
            if system_prompt is not None:
                self.db.execute("UPDATE conversations SET system_prompt = ? WHERE id = ?",
                                (system_prompt, conversation_id))
            if settings is not None:
                self.db.execute("UPDATE conversations SET settings = ? WHERE id = ?",
                                (json.dumps(settings), conversation_id))

    def delete(self, conversation_id: int) -> None:
        with self.db:
            self.db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))
            self._drop_unused_images()

    def image_count(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM images").fetchone()[0]

    def _drop_unused_images(self) -> None:
        self.db.execute("DELETE FROM images WHERE sha256 NOT IN (SELECT sha256 FROM message_images)")

    # -- turns -----------------------------------------------------------------------------------
    def replace_from(self, conversation_id: int, position: int, messages: Sequence[Message]) -> None:
        """Drop the messages at ``position`` and after, then store ``messages`` there, in one
        transaction (a new turn: position = the message count; a regenerate or an edit: the
        position of the user message it re-asks)."""
        now = time.time()
        for m in messages:
            for data in m.images:
                if len(data) > MAX_IMAGE_BYTES:
                    raise TandemError(f"an image of {len(data) / 2**20:.1f} MiB is over the "
                                      f"{MAX_IMAGE_BYTES / 2**20:.0f} MiB the chat history keeps")
        with self.db:
            if self.db.execute("SELECT 1 FROM conversations WHERE id = ?", (conversation_id,)).fetchone() is None:
                raise TandemError(f"conversation {conversation_id} no longer exists")
            self.db.execute("DELETE FROM message_images WHERE conversation_id = ? AND position >= ?",
                            (conversation_id, position))
            self.db.execute("DELETE FROM messages WHERE conversation_id = ? AND position >= ?",
                            (conversation_id, position))
            self.db.executemany(
                "INSERT INTO messages (conversation_id, position, role, content, stats, created) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                [(conversation_id, position + i, m.role, m.content, json.dumps(m.stats) if m.stats else None, now)
                 for i, m in enumerate(messages)])
            for i, m in enumerate(messages):
                for slot, data in enumerate(m.images):
                    key = image_key(data)
                    self.db.execute("INSERT OR IGNORE INTO images (sha256, data, created) VALUES (?, ?, ?)",
                                    (key, data, now))
                    self.db.execute("INSERT INTO message_images (conversation_id, position, slot, sha256) "
                                    "VALUES (?, ?, ?, ?)", (conversation_id, position + i, slot, key))
            self._drop_unused_images()
            self.db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))


def _conversation(row: tuple) -> Conversation:
    cid, title, created, updated, system_prompt, settings = row
    try:
        parsed = json.loads(settings or "{}")
    except ValueError:  # a hand-edited file: the conversation still opens, with default settings
        parsed = {}
    return Conversation(cid, title, created, updated, system_prompt, parsed if isinstance(parsed, dict) else {})


# -- export ------------------------------------------------------------------------------------------
def to_markdown(conv: Conversation) -> str:
    """A readable transcript: the title, the system prompt, then each turn under a heading."""
    out = [f"# {conv.display_title}", ""]
    if conv.system_prompt.strip():
        out += ["**System prompt**", "", _quote(conv.system_prompt), ""]
    for m in conv.messages:
        out += [f"## {'You' if m.role == 'user' else 'Assistant'}", "", m.content.rstrip(), ""]
        if m.role == "assistant" and m.stats:
            out += [f"*{stats_line(m.stats)}*", ""]
    return "\n".join(out).rstrip() + "\n"


def to_json(conv: Conversation) -> str:
    doc: dict[str, Any] = {
        "format": FORMAT, "version": 1, "title": conv.display_title, "created": conv.created,
        "updated": conv.updated, "system_prompt": conv.system_prompt, "settings": conv.settings,
        "messages": [{"role": m.role, "content": m.content, **({"stats": m.stats} if m.stats else {}),
                      **({"images": [image_key(d) for d in m.images]} if m.images else {})}
                     for m in conv.messages],
    }
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def stats_line(stats: dict) -> str:
    """An answer's numbers in one line (exports; the app's footer has its own richer form)."""
    bits = [f"{stats.get('tokens', 0)} tokens"]
    if stats.get("decode_tps"):
        bits.append(f"{stats['decode_tps']:.1f} tok/s")
    if stats.get("mode"):
        bits.append(f"mode {stats['mode']}")
    if stats.get("model"):
        bits.append(str(stats["model"]))
    return " · ".join(bits)


def _quote(text: str) -> str:
    return "\n".join("> " + line if line else ">" for line in text.strip().splitlines())
