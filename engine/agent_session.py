"""A coding agent's session, built from Tandem's own source: the requests ``tandem benchmark
--agent-replay`` replays.

The agent's task is a rename across the engine package: a helper used by several modules
(``pick_symbol``: ``cache_root`` while it exists) gets a new name. Its loop, as a recorded trace:
grep for the helper, read its definition, edit it, then read and edit each module that uses it
(the same edit each time), run the tests (an import error: one module was missed), grep again,
read that module again, edit it, run the tests (all pass), and sum up; beside it, one request
of a reviewer sub-agent in a fresh conversation, asked to review the diff. Tool results are
real: grep hits, numbered file lines before and after each edit and the unified diff come from
the installed source; the test runs are pytest-shaped text naming the real modules and the real
import line.

Each request is the whole conversation so far, as an agent sends it (system prompt with the
tool descriptions, the task, then the agent's tool calls and their results as user turns), so
the files read come back in later requests again. The agent's turns are the trace's own (a
replay: what the replayed model writes is timed, not fed back). Everything is a function of
the installed source: the same version gives the same session.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass, field

from engine.corpus import source_files, source_text
from engine.errors import TandemError

PREFERRED = "cache_root"  # the helper renamed while the engine has it (comparable runs across versions)
NEW_SUFFIX = "_path"  # ... renamed to <name>_path
FIRST_PASS = 3  # modules edited before the first test run (one more is left for the failing run to find)
READ_BEFORE = 12  # lines shown before the line a read is about
READ_LINES = 40

TOOLS = [
    {"name": "grep", "description": "Search the repository's files for a regular expression. Prints path:line:text "
                                    "for every matching line, sorted by path.",
     "parameters": {"type": "object", "properties": {
         "pattern": {"type": "string", "description": "a Python regular expression"},
         "path": {"type": "string", "description": "a folder or file to search (default: the repository)"}},
         "required": ["pattern"]}},
    {"name": "read_file", "description": "Read lines of a file, numbered like cat -n.",
     "parameters": {"type": "object", "properties": {
         "path": {"type": "string"},
         "offset": {"type": "integer", "description": "the first line to show (1-based)"},
         "limit": {"type": "integer", "description": "how many lines to show"}},
         "required": ["path"]}},
    {"name": "edit_file", "description": "Replace an exact string in a file. Fails unless old_string occurs exactly "
                                         "once, or replace_all is true. Prints the edited lines with their numbers.",
     "parameters": {"type": "object", "properties": {
         "path": {"type": "string"}, "old_string": {"type": "string"}, "new_string": {"type": "string"},
         "replace_all": {"type": "boolean", "description": "replace every occurrence"}},
         "required": ["path", "old_string", "new_string"]}},
    {"name": "run_tests", "description": "Run the test suite with pytest (-x -q) and print its output.",
     "parameters": {"type": "object", "properties": {
         "args": {"type": "string", "description": "extra pytest arguments, e.g. a test file"}}}},
]

SYSTEM = """You are a coding agent working in a Python repository: Tandem, an engine for lossless \
speculative decoding on MLX, with its command line (engine/cli), its server (engine/serve) and a \
desktop app (app/). You act only through tools. Answer with at most one tool call per turn, as JSON in \
a <tool_call> block:
<tool_call>
{"name": "read_file", "arguments": {"path": "engine/paths.py", "offset": 1, "limit": 40}}
</tool_call>
and wait: its result comes back in a <tool_response> block. Before the call, say in one sentence \
what you are doing and why. When the task is done, reply with a short summary of what changed and \
no tool call.

Tools:
""" + "\n".join(json.dumps(t) for t in TOOLS) + """

Rules:
- Read the part of a file you edit first; keep edits minimal and in the file's style.
- Never change behaviour that the task did not ask to change.
- Run the tests after your edits, and fix what they show before you finish.
- Paths are relative to the repository root."""

REVIEWER = """You review code changes in the Tandem repository. You are given a unified diff. Say whether \
the change is complete and safe: renamed names that are still used under the old name, imports \
that no longer resolve, behaviour that changed. Answer with a short list of findings, most important \
first, then a one-line verdict."""


@dataclass
class Session:
    """The requests (each the chat messages an agent sends) and what each one added."""

    symbol: str
    new_name: str
    requests: list[list[dict]] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)  # per request: the tool result it ends with


def uses(text: str, name: str) -> bool:
    """Whether the code calls or imports ``name`` (a mention in prose does not count)."""
    return re.search(rf"\b{name}\s*\(|^\s*(from|import) [^\n]*\b{name}\b", text, re.M) is not None


def pick_symbol(texts: dict[str, str]) -> tuple[str, str]:
    """(helper name, its module): ``PREFERRED`` while it is defined and used in 3+ other modules,
    else the public top-level function (a name with an underscore) used in the most other
    modules (the most mentions, then the name, breaking ties)."""
    defined: dict[str, str] = {}
    for path, text in texts.items():
        for m in re.finditer(r"^def ([a-z][a-z0-9]*_[a-z0-9_]+)\(", text, re.M):
            defined.setdefault(m.group(1), path)

    def users(name: str) -> list[str]:
        return [p for p, t in texts.items() if p != defined[name] and uses(t, name)]

    if PREFERRED in defined and len(users(PREFERRED)) >= 3:
        return PREFERRED, defined[PREFERRED]
    scored = [(len(users(n)), sum(len(re.findall(rf"\b{n}\b", texts[p])) for p in users(n)), n) for n in defined]
    best = max((s for s in scored if s[0] >= 3), default=None, key=lambda s: (s[0], s[1], s[2]))
    if best is None:
        raise TandemError("no helper used across modules to build the agent session from")
    return best[2], defined[best[2]]


# ------------------------------------------------------------------ tool output
def numbered(text: str, first: int, count: int) -> str:
    """Lines first..first+count-1 (1-based) of ``text``, numbered like ``cat -n``."""
    lines = text.splitlines()
    return "\n".join(f"{n:6d}\t{lines[n - 1]}" for n in range(max(1, first), min(len(lines), first + count - 1) + 1))


def grep(texts: dict[str, str], name: str) -> str:
    hits = [f"{path}:{n}:{line}" for path, text in sorted(texts.items())
            for n, line in enumerate(text.splitlines(), 1) if re.search(rf"\b{name}\b", line)]
    return "\n".join(hits) if hits else "(no matches)"


def first_hit(text: str, name: str) -> int:
    return next(n for n, line in enumerate(text.splitlines(), 1) if re.search(rf"\b{name}\b", line))


def rename(text: str, old: str, new: str) -> str:
    return re.sub(rf"\b{old}\b", new, text)


def edit_result(path: str, before: str, after: str, old: str) -> str:
    count = len(re.findall(rf"\b{old}\b", before))
    line = first_hit(before, old)
    return (f"The file {path} has been updated ({count} replacement{'s' if count != 1 else ''}). The edited lines:\n"
            + numbered(after, line - 3, 7))


def test_module(path: str) -> str:
    return f"tests/test_{path.rsplit('/', 1)[-1].removesuffix('.py')}.py"


def tests_passed(paths: list[str], texts: dict[str, str]) -> str:
    """A passing ``pytest -x -q`` run over a test module per edited module (a dot per function)."""
    rows, total = [], 0
    for path in paths:
        n = max(1, len(re.findall(r"^def ", texts[path], re.M)))
        total += n
        rows.append((test_module(path), n))
    out = ["============================= test session starts ==============================",
           "platform linux -- Python 3.11, pytest-8.3.4, pluggy-1.5.0", "rootdir: /repo", "configfile: pyproject.toml",
           f"collected {total} items", ""]
    done = 0
    for name, n in rows:
        done += n
        out.append(f"{name} {'.' * n}".ljust(72) + f"[{100 * done // total:3d}%]")
    out += ["", f"============================== {total} passed in {0.07 * total + 1.5:.2f}s =============================="]
    return "\n".join(out)


def tests_failed(path: str, text: str, old: str, home: str) -> str:
    """``pytest -x -q`` stopped by an import error: ``path`` still imports the old name."""
    line = first_hit(text, old)
    module = home.removesuffix(".py").replace("/", ".")
    test = test_module(path)
    source = text.splitlines()[line - 1].strip()
    return "\n".join([
        "============================= test session starts ==============================",
        "platform linux -- Python 3.11, pytest-8.3.4, pluggy-1.5.0", "rootdir: /repo", "configfile: pyproject.toml",
        "collected 0 items / 1 error", "",
        "==================================== ERRORS ====================================",
        f"_{f' ERROR collecting {test} '.center(78, '_')}",
        f"ImportError while importing test module '/repo/{test}'.",
        "Hint: make sure your test modules/packages have valid Python names.", "Traceback:",
        f"{test}:9: in <module>", f"    from {path.removesuffix('.py').replace('/', '.')} import *",
        f"{path}:{line}: in <module>", f"    {source}",
        f"E   ImportError: cannot import name '{old}' from '{module}' (/repo/{home})",
        "=========================== short test summary info ============================",
        f"ERROR {test}", "!!!!!!!!!!!!!!!!!!!! Interrupted: 1 error during collection !!!!!!!!!!!!!!!!!!!!",
        "1 error in 0.84s"])


# ------------------------------------------------------------------ the session
def call(say: str, name: str, **arguments) -> str:
    return f"{say}\n<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def response(text: str) -> str:
    return f"<tool_response>\n{text}\n</tool_response>"


def build_session() -> Session:
    """The replayed session (see the module docstring)."""
    own = f"engine/{__name__.rsplit('.', 1)[-1]}.py"  # this module names the helper: not part of the repository
    texts = {path: source_text(path) for path in source_files() if path != own}
    old, home = pick_symbol(texts)
    new = old + NEW_SUFFIX
    users = sorted(p for p, t in texts.items() if p != home and uses(t, old))
    first, missed = users[:FIRST_PASS], users[FIRST_PASS]
    session = Session(old, new)
    before = dict(texts)
    chat = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Rename the helper `{old}` (defined in {home}) to `{new}` everywhere in "
                                        f"the engine package, without changing what it does, and make sure the tests "
                                        f"still pass."}]

    def request(label: str) -> None:
        session.requests.append([dict(m) for m in chat])
        session.labels.append(label)

    def turn(say: str, tool: str, result: str, **arguments) -> None:
        chat.append({"role": "assistant", "content": call(say, tool, **arguments)})
        chat.append({"role": "user", "content": response(result)})
        request(tool)

    def read(path: str, say: str) -> None:
        offset = max(1, first_hit(texts[path], old) - READ_BEFORE)  # every read comes before its edit
        turn(say, "read_file", numbered(texts[path], offset, READ_LINES), path=path, offset=offset, limit=READ_LINES)

    def edit(path: str, say: str) -> None:
        edited = rename(texts[path], old, new)
        result = edit_result(path, texts[path], edited, old)
        texts[path] = edited
        turn(say, "edit_file", result, path=path, old_string=old, new_string=new, replace_all=True)

    request("task")
    turn(f"First I find every use of `{old}`.", "grep", grep(texts, old), pattern=rf"\b{old}\b", path="engine")
    read(home, f"Now the definition in {home}.")
    edit(home, f"I rename the definition (and its uses inside {home}).")
    for path in first:
        read(path, f"{path} uses it too; I read where.")
        edit(path, f"The same rename in {path}.")
    turn("Now the tests.", "run_tests", tests_failed(missed, texts[missed], old, home))
    turn(f"One module still imports `{old}`; I search again for what is left.", "grep", grep(texts, old),
         pattern=rf"\b{old}\b", path="engine")
    read(missed, f"{missed} was missed; I read it again.")
    edit(missed, f"The same rename in {missed}.")
    turn("The tests again.", "run_tests", tests_passed([home] + first + [missed], texts))
    diff = "".join(line for p in [home] + first + [missed]
                   for line in difflib.unified_diff(before[p].splitlines(True), texts[p].splitlines(True),
                                                    f"a/{p}", f"b/{p}", n=3))
    session.requests.append([{"role": "system", "content": REVIEWER},
                             {"role": "user", "content": f"Review this change:\n\n{diff}"}])
    session.labels.append("review (sub-agent)")
    return session
