"""Model output as HTML for Qt's rich text (QTextBrowser): Markdown (markdown-it-py, CommonMark plus
tables and strikethrough), fenced code highlighted by Pygments with a Copy link per block, and
``<think>...</think>`` reasoning folded behind a link. No Qt here: the view turns the links
(``copy:N``, ``think:N``) into actions.

Qt's HTML subset shapes the output: inline styles only (no classes), padding only on table cells,
so a code block is a one-cell-wide table. Raw HTML in the text is escaped, never interpreted.
A partial message (streaming) renders as it stands: an unclosed fence is a code block to the end,
an unclosed ``<think>`` is reasoning still being written.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional

from markdown_it import MarkdownIt
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name
from pygments.lexers.special import TextLexer
from pygments.util import ClassNotFound

# Colours per theme; app.theme passes the matching one.
LIGHT = {"text": "#111827", "muted": "#6b7280", "link": "#3563e9", "code_bg": "#f6f8fa", "code_border": "#e5e7eb",
         "code_head": "#eef0f3", "inline_code_bg": "#eef0f3", "think_bg": "#f9fafb", "table_border": "#d1d5db",
         "table_head": "#f3f4f6", "pygments": "default"}
DARK = {"text": "#e5e7eb", "muted": "#9ca3af", "link": "#8aa9ff", "code_bg": "#0d1117", "code_border": "#30363d",
        "code_head": "#161b22", "inline_code_bg": "#2d333b", "think_bg": "#1c2128", "table_border": "#444c56",
        "table_head": "#22272e", "pygments": "github-dark"}

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_THINK = re.compile(r"<think>|</think>")


@dataclass
class Segment:
    kind: str  # "text" or "think"
    text: str
    closed: bool = True  # think: False while the model is still reasoning


@dataclass
class Rendered:
    html: str
    code_blocks: list[str] = field(default_factory=list)  # "copy:N" copies code_blocks[N]
    thoughts: int = 0  # "think:N" toggles reasoning block N


def split_think(text: str) -> list[Segment]:
    """Split reasoning from the answer. A ``</think>`` with no opening tag, before any answer,
    closes reasoning that began in the prompt (chat templates that open ``<think>`` themselves)."""
    out: list[Segment] = []
    inside = False
    pos = 0
    for m in _THINK.finditer(text):
        chunk = text[pos:m.start()]
        if m.group() == THINK_OPEN:
            if inside:  # a literal "<think>" inside reasoning stays part of it
                continue
            if chunk.strip():
                out.append(Segment("text", chunk))
            inside = True
        elif inside or not out:
            out.append(Segment("think", chunk))
            inside = False
        else:  # a stray "</think>" in the answer is plain text
            continue
        pos = m.end()
    rest = text[pos:]
    if inside:
        out.append(Segment("think", rest, closed=False))
    elif rest.strip() or not out:
        out.append(Segment("text", rest))
    return out


def render(text: str, palette: Optional[dict] = None, *, expanded: frozenset[int] | set[int] = frozenset()) -> Rendered:
    """The HTML of one message. ``expanded`` holds the reasoning blocks shown in full."""
    pal = palette or LIGHT
    env = {"code_blocks": [], "palette": pal}
    parts: list[str] = []
    thoughts = 0
    for seg in split_think(text):
        if seg.kind == "text":
            parts.append(_md().render(seg.text, env))
            continue
        i = thoughts
        thoughts += 1
        words = len(seg.text.split())
        label = "Thinking…" if not seg.closed else f"Reasoning · {words} word{'s' * (words != 1)}"
        arrow = "▾" if i in expanded else "▸"
        parts.append(f"<p style='margin:2px 0'><a href='think:{i}' style='color:{pal['muted']};"
                     f"text-decoration:none'>{arrow} {label}</a></p>")
        if i in expanded and seg.text.strip():
            body = _md().render(seg.text, env)
            parts.append(f"<table width='100%' cellspacing='0' cellpadding='8' style='margin-bottom:6px'>"
                         f"<tr><td bgcolor='{pal['think_bg']}' style='color:{pal['muted']}'>{body}</td></tr></table>")
    return Rendered("".join(parts), env["code_blocks"], thoughts)


def plain_text(text: str) -> str:
    """What "Copy" on a message gives: the text without its reasoning."""
    answer = [s.text for s in split_think(text) if s.kind == "text"]
    return "".join(answer).strip()


# -- markdown-it set-up --------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def _md() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False, "breaks": True, "linkify": False}).enable(["table", "strikethrough"])
    md.add_render_rule("fence", _fence)
    md.add_render_rule("code_block", _fence)
    md.add_render_rule("code_inline", _code_inline)
    md.add_render_rule("table_open", _table_open)
    md.add_render_rule("th_open", _cell_open)
    md.add_render_rule("td_open", _cell_open)
    md.add_render_rule("blockquote_open", _blockquote_open)
    md.add_render_rule("blockquote_close", lambda self, tokens, idx, options, env: "</td></tr></table>")
    md.add_render_rule("link_open", _link_open)
    return md


def _fence(self, tokens, idx, options, env) -> str:
    token = tokens[idx]
    pal = env["palette"]
    lang = token.info.strip().split()[0] if token.info.strip() else ""
    code = token.content
    n = len(env["code_blocks"])
    env["code_blocks"].append(code.rstrip("\n"))
    body = highlight_code(code.rstrip("\n"), lang, pal["pygments"])
    # the header is one cell holding a borderless table, so no rule is drawn between name and link
    head = (f"<tr><td bgcolor='{pal['code_head']}'><table width='100%' cellspacing='0' cellpadding='0' border='0'>"
            f"<tr><td style='color:{pal['muted']}'><small>{html.escape(lang or 'text')}</small></td>"
            f"<td align='right'><small><a href='copy:{n}' style='color:{pal['link']};text-decoration:none'>Copy</a>"
            f"</small></td></tr></table></td></tr>")
    return (f"<table width='100%' cellspacing='0' cellpadding='6' border='1' style='border-collapse:collapse;"
            f"border-color:{pal['code_border']};border-style:solid;margin-top:4px;margin-bottom:8px'>{head}"
            f"<tr><td bgcolor='{pal['code_bg']}'><pre style='margin:0;white-space:pre-wrap'>{body}</pre>"
            f"</td></tr></table>")


@lru_cache(maxsize=512)
def highlight_code(code: str, lang: str, style: str) -> str:
    """Pygments' inline-styled HTML for one block (cached: a streaming message re-renders its
    finished blocks many times)."""
    try:
        lexer = get_lexer_by_name(lang) if lang else TextLexer()
    except ClassNotFound:
        lexer = TextLexer()
    out = highlight(code, lexer, HtmlFormatter(nowrap=True, noclasses=True, style=style))
    return out[:-1] if out.endswith("\n") else out


def _code_inline(self, tokens, idx, options, env) -> str:
    bg = env["palette"]["inline_code_bg"]
    return f"<code style='background-color:{bg}'>{html.escape(tokens[idx].content)}</code>"


def _table_open(self, tokens, idx, options, env) -> str:
    pal = env["palette"]
    return (f"<table cellspacing='0' cellpadding='6' border='1' style='border-collapse:collapse;"
            f"border-color:{pal['table_border']};border-style:solid;margin-top:4px;margin-bottom:8px'>")


def _cell_open(self, tokens, idx, options, env) -> str:
    token = tokens[idx]
    style = token.attrGet("style") or ""
    align = {"text-align:left": "left", "text-align:center": "center", "text-align:right": "right"}.get(style, "")
    bg = f" bgcolor='{env['palette']['table_head']}'" if token.tag == "th" else ""
    return f"<{token.tag}{bg}" + (f" align='{align}'" if align else "") + ">"


def _blockquote_open(self, tokens, idx, options, env) -> str:
    pal = env["palette"]
    return (f"<table cellspacing='0' cellpadding='4' style='margin:4px 0'><tr>"
            f"<td width='3' bgcolor='{pal['code_border']}'></td><td style='color:{pal['muted']}'>")


def _link_open(self, tokens, idx, options, env) -> str:
    href = tokens[idx].attrGet("href") or ""
    return f"<a href='{html.escape(href, quote=True)}' style='color:{env['palette']['link']}'>"
