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

``build_delegating_session`` does the same rename the way an agent with sub-agents does it: each
module that uses the helper goes to a sub-agent in a fresh conversation, so what one sub-agent
read and wrote is in no later request's own context.
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

TASK_TOOL = {"name": "task", "description": "Hand a self-contained job to a sub-agent, which starts a fresh "
                                       "conversation with the same tools; its one-line report comes back.",
             "parameters": {"type": "object", "properties": {
                 "description": {"type": "string", "description": "three to five words"},
                 "prompt": {"type": "string", "description": "the whole job: the sub-agent sees nothing else"}},
                 "required": ["description", "prompt"]}}

PREAMBLE = """You are a coding agent working in a Python repository: Tandem, an engine for lossless \
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
"""

RULES = """

Rules:
- Read the part of a file you edit first; keep edits minimal and in the file's style.
- Never change behaviour that the task did not ask to change.
- Run the tests after your edits, and fix what they show before you finish.
- Paths are relative to the repository root."""


def system_prompt(tools: list[dict], rules: str = RULES) -> str:
    return PREAMBLE + "\n".join(json.dumps(t) for t in tools) + rules


SYSTEM = system_prompt(TOOLS)
DELEGATING = system_prompt(TOOLS + [TASK_TOOL], RULES + """
- Hand each module's edit to a sub-agent (the task tool) once you know which lines it needs.""")
SUB_AGENT = system_prompt(TOOLS[:3], """

Rules:
- Do only the job you are given; the lines it names are current, so edit without reading them again.
- Never change behaviour that the job did not ask to change.
- Finish with one line saying what changed.""")

REVIEWER = """You review code changes in the Tandem repository. You are given a unified diff. Say whether \
the change is complete and safe: renamed names that are still used under the old name, imports \
that no longer resolve, behaviour that changed. Answer with a short list of findings, most important \
first, then a one-line verdict."""


@dataclass
class Session:
    """The requests (each the chat messages an agent sends) and what each one added."""

    symbol: str
    new_name: str
    shape: str = "single"  # one conversation; "delegating": sub-agents in fresh conversations
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


def replacements(text: str, old: str) -> str:
    """How many uses of ``old`` a ``replace_all`` edit of ``text`` replaces, in words."""
    count = len(re.findall(rf"\b{old}\b", text))
    return f"{count} replacement{'s' if count != 1 else ''}"


def edit_result(path: str, before: str, after: str, old: str) -> str:
    line = first_hit(before, old)
    return (f"The file {path} has been updated ({replacements(before, old)}). The edited lines:\n"
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


@dataclass
class Workspace:
    """The repository as both sessions find it: the helper, its new name, its module and its users."""

    texts: dict[str, str]
    old: str
    new: str
    home: str
    users: list[str]

    @classmethod
    def load(cls) -> "Workspace":
        own = f"engine/{__name__.rsplit('.', 1)[-1]}.py"  # this module names the helper: not part of the repository
        texts = {path: source_text(path) for path in source_files() if path != own}
        old, home = pick_symbol(texts)
        users = sorted(p for p, t in texts.items() if p != home and uses(t, old))
        return cls(texts, old, old + NEW_SUFFIX, home, users[:FIRST_PASS + 1])  # the modules the sessions edit

    def task(self) -> str:
        return (f"Rename the helper `{self.old}` (defined in {self.home}) to `{self.new}` everywhere in the engine "
                f"package, without changing what it does, and make sure the tests still pass.")

    def grep(self, chat: "Conversation", say: str) -> None:
        chat.turn(say, "grep", grep(self.texts, self.old), pattern=rf"\b{self.old}\b", path="engine")

    def read(self, chat: "Conversation", path: str, say: str) -> None:
        offset = max(1, first_hit(self.texts[path], self.old) - READ_BEFORE)  # every read comes before its edit
        chat.turn(say, "read_file", numbered(self.texts[path], offset, READ_LINES), path=path, offset=offset,
                  limit=READ_LINES)

    def edit(self, chat: "Conversation", path: str, say: str) -> None:
        edited = rename(self.texts[path], self.old, self.new)
        result = edit_result(path, self.texts[path], edited, self.old)
        self.texts[path] = edited
        chat.turn(say, "edit_file", result, path=path, old_string=self.old, new_string=self.new, replace_all=True)

    def review(self, session: Session, before: dict[str, str]) -> None:
        """The reviewer sub-agent's one request: a fresh conversation given the whole diff."""
        diff = "".join(line for p in [self.home] + self.users
                       for line in difflib.unified_diff(before[p].splitlines(True), self.texts[p].splitlines(True),
                                                        f"a/{p}", f"b/{p}", n=3))
        session.requests.append([{"role": "system", "content": REVIEWER},
                                 {"role": "user", "content": f"Review this change:\n\n{diff}"}])
        session.labels.append("review (sub-agent)")


class Conversation:
    """One agent's chat: each tool result it gets ends a request of the session."""

    def __init__(self, session: Session, system: str, task: str, label: str = ""):
        self.session, self.label = session, label
        self.chat = [{"role": "system", "content": system}, {"role": "user", "content": task}]
        self.request("task")

    def request(self, after: str) -> None:
        self.session.requests.append([dict(m) for m in self.chat])
        self.session.labels.append(self.label + after)

    def turn(self, say: str, tool: str, result: str, **arguments) -> None:
        self.chat.append({"role": "assistant", "content": call(say, tool, **arguments)})
        self.chat.append({"role": "user", "content": response(result)})
        self.request(tool)


def build_session() -> Session:
    """The replayed session (see the module docstring)."""
    ws = Workspace.load()
    old, home = ws.old, ws.home
    first, missed = ws.users[:FIRST_PASS], ws.users[FIRST_PASS]
    session = Session(old, ws.new)
    before = dict(ws.texts)
    chat = Conversation(session, SYSTEM, ws.task())
    ws.grep(chat, f"First I find every use of `{old}`.")
    ws.read(chat, home, f"Now the definition in {home}.")
    ws.edit(chat, home, f"I rename the definition (and its uses inside {home}).")
    for path in first:
        ws.read(chat, path, f"{path} uses it too; I read where.")
        ws.edit(chat, path, f"The same rename in {path}.")
    chat.turn("Now the tests.", "run_tests", tests_failed(missed, ws.texts[missed], old, home))
    ws.grep(chat, f"One module still imports `{old}`; I search again for what is left.")
    ws.read(chat, missed, f"{missed} was missed; I read it again.")
    ws.edit(chat, missed, f"The same rename in {missed}.")
    chat.turn("The tests again.", "run_tests", tests_passed([home] + ws.users, ws.texts))
    ws.review(session, before)
    return session


def build_delegating_session() -> Session:
    """The same rename, done the way an agent with sub-agents does it (Claude Code's Task tool): the
    agent renames the definition itself, then hands each module that uses the helper to a sub-agent,
    which starts a fresh conversation, edits the lines it is given and reports in one line. What one
    sub-agent wrote is in no later sub-agent's context: only an index over earlier requests has it."""
    ws = Workspace.load()
    old, new, home = ws.old, ws.new, ws.home
    session = Session(old, new, shape="delegating")
    before = dict(ws.texts)
    hits = grep(ws.texts, old).splitlines()
    chat = Conversation(session, DELEGATING, ws.task())
    ws.grep(chat, f"First I find every use of `{old}`.")
    ws.read(chat, home, f"Now the definition in {home}.")
    ws.edit(chat, home, f"I rename the definition (and its uses inside {home}).")
    for path in ws.users:
        lines = "\n".join(h for h in hits if h.startswith(path + ":"))
        job = (f"In {path}, rename the helper `{old}` to `{new}` (its definition in {home} is renamed already): "
               f"its import and every use. The lines that name it now:\n{lines}")
        replaced = replacements(ws.texts[path], old)
        sub = Conversation(session, SUB_AGENT, job, label="sub-agent ")
        ws.edit(sub, path, f"I rename every use in {path} at once.")
        report = f"Renamed `{old}` to `{new}` in {path} ({replaced})."
        chat.turn(f"{path} uses it too; a sub-agent renames it there.", "task", report,
                  description=f"rename in {path}", prompt=job)
    chat.turn("Now the tests.", "run_tests", tests_passed([home] + ws.users, ws.texts))
    ws.review(session, before)
    return session
