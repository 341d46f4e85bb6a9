"""``tandem claude``: run Claude Code against a running ``tandem serve``.

    tandem serve &                      # in another terminal
    tandem claude [-- claude args...]   # Claude Code, answered by the local model
    tandem claude --print-env           # or: eval "$(tandem claude --print-env)"; claude
    tandem claude --print-settings > .claude/settings.local.json   # or: this project's claude, always

Only the environment of the one ``claude`` child process is set: ANTHROPIC_BASE_URL (the
server), ANTHROPIC_AUTH_TOKEN (the server's key, else a placeholder; Claude Code sends it as a
Bearer token), ANTHROPIC_API_KEY emptied (so a real Anthropic key in your shell is not sent
to the local server), ANTHROPIC_MODEL and the small/fast and per-tier default models (all the
served model: the server answers every model name), CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC
(no telemetry or update checks to Anthropic) and API_TIMEOUT_MS (local prefill of Claude Code's
long system prompt can take minutes on a CPU). No file or setting is changed.

``--print-settings`` prints the same variables as a project-scoped ``.claude/settings.local.json``
block (``{"env": {...}}``: Claude Code's personal per-project settings, applied over its
environment): the provider switches found in this shell are set empty there, since the file
cannot unset them. It carries the server's key when one is given: keep the file out of git.

Prompts must stay on this machine, so the child gets none of the variables that make Claude Code
use another provider or transport (they take precedence over ANTHROPIC_BASE_URL): the provider
switches (CLAUDE_CODE_USE_BEDROCK, _VERTEX, _FOUNDRY, _ANTHROPIC_AWS, _MANTLE and any later
CLAUDE_CODE_USE_* but known local features), their endpoints and credentials (ANTHROPIC_BEDROCK_*,
ANTHROPIC_VERTEX_*, ANTHROPIC_FOUNDRY_*, ANTHROPIC_AWS_*, AWS_BEARER_TOKEN_BEDROCK,
CLAUDE_CODE_SKIP_*_AUTH), the claude.ai login and key hand-offs (CLAUDE_CODE_OAUTH_TOKEN,
CLAUDE_CODE_API_KEY_FILE_DESCRIPTOR), other transports (ANTHROPIC_UNIX_SOCKET,
CLAUDE_CODE_API_BASE_URL) and ANTHROPIC_CUSTOM_HEADERS (a gateway's credentials). For a local
server the loopback names join NO_PROXY, so an HTTP(S)_PROXY does not relay the prompts. A
Claude Code settings file whose ``env`` selects a provider, another transport or another
ANTHROPIC_BASE_URL would win over all this (Claude Code applies it over its environment): then
tandem refuses to start Claude Code and names the file. The key itself travels only in the child's
environment (--api-key-file or $TANDEM_API_KEY keep it out of ps too).

Claude Code's system prompt and tool list are long (tens of thousands of tokens); a model with a
small context (the starter's is 8192) answers with "prompt is too long", which the server says
plainly. A larger local model is needed for real agent work.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shlex
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterable, Mapping
from urllib.parse import urlsplit

from engine.cli.serve import add_api_key_arguments, api_key_from
from engine.errors import TandemError

PLACEHOLDER_TOKEN = "tandem-local"

# Variables that send Claude Code's requests elsewhere than ANTHROPIC_BASE_URL (see the module doc).
PROVIDER_PREFIXES = ("CLAUDE_CODE_USE_", "ANTHROPIC_BEDROCK_", "ANTHROPIC_VERTEX_", "ANTHROPIC_FOUNDRY_",
                     "ANTHROPIC_AWS_")
PROVIDER_VARIABLES = frozenset({"AWS_BEARER_TOKEN_BEDROCK", "CLAUDE_CODE_OAUTH_TOKEN",
                                "CLAUDE_CODE_API_KEY_FILE_DESCRIPTOR", "ANTHROPIC_UNIX_SOCKET",
                                "CLAUDE_CODE_API_BASE_URL", "ANTHROPIC_CUSTOM_HEADERS"})
LOCAL_FEATURES = frozenset({"CLAUDE_CODE_USE_NATIVE_FILE_SEARCH"})  # CLAUDE_CODE_USE_* that pick no provider
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def is_provider_variable(name: str) -> bool:
    name = name.upper()
    if name in LOCAL_FEATURES:
        return False
    return (name in PROVIDER_VARIABLES or name.startswith(PROVIDER_PREFIXES)
            or (name.startswith("CLAUDE_CODE_SKIP_") and name.endswith("_AUTH")))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="the tandem server's host (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="the tandem server's port (default 8080)")
    p.add_argument("--url", default=None, help="the server's base URL (overrides --host/--port)")
    add_api_key_arguments(p, "the key the server was started with")
    p.add_argument("--model", default=None, help="model name to ask for (default: the one the server serves)")
    p.add_argument("--print-env", action="store_true", help="print the environment as shell exports and exit")
    p.add_argument("--print-settings", action="store_true",
                   help="print a .claude/settings.local.json block (project-scoped) with the same settings and exit")
    p.add_argument("--claude", default="claude", help="the Claude Code executable (default: 'claude' on PATH)")
    p.add_argument("claude_args", nargs=argparse.REMAINDER, help="arguments passed to claude (after --)")


def base_url(args: argparse.Namespace) -> str:
    if args.url:
        return args.url.rstrip("/")
    host = f"[{args.host}]" if ":" in args.host else args.host
    return f"http://{host}:{args.port}"


def served_model(url: str, api_key: str | None, timeout: float = 5.0) -> str:
    """The model name from the server's /v1/models (also proves the server is up and the key is right)."""
    req = urllib.request.Request(url + "/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            data = json.load(resp)
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise TandemError(f"the server at {url} wants an API key: pass the one it was started with (--api-key)") from None
        raise TandemError(f"the server at {url} answered /v1/models with HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise TandemError(f"no tandem server at {url} ({reason}); start one with: tandem serve") from None
    try:
        return data["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        raise TandemError(f"{url}/v1/models did not list a model; is this a tandem server?") from None


def claude_env(url: str, model: str, api_key: str | None) -> dict[str, str]:
    """The variables set for the claude child (and printed by --print-env)."""
    return {
        "ANTHROPIC_BASE_URL": url,
        "ANTHROPIC_AUTH_TOKEN": api_key or PLACEHOLDER_TOKEN,
        "ANTHROPIC_API_KEY": "",
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "CLAUDE_CODE_SUBAGENT_MODEL": model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "API_TIMEOUT_MS": "3000000",
    }


def _is_loopback(url: str) -> bool:
    host = (urlsplit(url).hostname or "").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def child_env(environ: Mapping[str, str], url: str, model: str, api_key: str | None) -> dict[str, str]:
    """The claude child's environment: ``environ`` without the provider variables, plus ours."""
    env = {k: v for k, v in environ.items() if not is_provider_variable(k)}
    if _is_loopback(url):  # never through a proxy (which would take the prompts off the machine)
        have = [h.strip() for var in ("NO_PROXY", "no_proxy") for h in env.get(var, "").split(",") if h.strip()]
        env["NO_PROXY"] = env["no_proxy"] = ",".join(dict.fromkeys(have + list(LOOPBACK_NAMES)))
    return {**env, **claude_env(url, model, api_key)}


def settings_files(home: Path | None = None, cwd: Path | None = None) -> list[Path]:
    """Claude Code's settings files whose ``env`` it applies on top of the process environment."""
    home, cwd = home or Path.home(), cwd or Path.cwd()
    user = Path(os.environ["CLAUDE_CONFIG_DIR"]) if os.environ.get("CLAUDE_CONFIG_DIR") else home / ".claude"
    managed = (Path("/Library/Application Support/ClaudeCode") if sys.platform == "darwin"
               else Path(os.environ.get("ProgramData", "C:/ProgramData")) / "ClaudeCode" if sys.platform == "win32"
               else Path("/etc/claude-code"))
    return [user / "settings.json", cwd / ".claude" / "settings.json", cwd / ".claude" / "settings.local.json",
            managed / "managed-settings.json"]


def routes_elsewhere(name: str, value: object, url: str) -> bool:
    """A settings-file ``env`` entry that would send requests somewhere else than ``url``: a provider
    switch, a transport override, or another ANTHROPIC_BASE_URL (credentials alone go nowhere)."""
    name = name.upper()
    if value in ("", "0", "false", None, False):
        return False
    if name == "ANTHROPIC_BASE_URL":
        return str(value).rstrip("/") != url.rstrip("/")
    return name in ("ANTHROPIC_UNIX_SOCKET", "CLAUDE_CODE_API_BASE_URL") or (
        name.startswith("CLAUDE_CODE_USE_") and name not in LOCAL_FEATURES)


def check_settings(files: Iterable[Path], url: str) -> None:
    """Refuse when a settings file's ``env`` routes requests elsewhere: Claude Code applies it over
    the environment it was started with."""
    for path in files:
        try:
            env = json.loads(path.read_text(encoding="utf-8")).get("env")
        except (OSError, ValueError, AttributeError):
            continue  # absent or unreadable: Claude Code would not apply it either
        if not isinstance(env, dict):
            continue
        chosen = sorted(k for k, v in env.items() if routes_elsewhere(k, v, url))
        if chosen:
            raise TandemError(f"{path} sets {', '.join(chosen)} in its \"env\": Claude Code would send your prompts "
                              "there instead of to the local server; remove it from that file to use tandem claude")


def settings_block(environ: Mapping[str, str], url: str, model: str, api_key: str | None) -> dict:
    """``{"env": ...}`` for a project's ``.claude/settings.local.json``: our variables, the loopback
    NO_PROXY, and the provider variables set in ``environ`` emptied (a settings file cannot unset)."""
    env = child_env(environ, url, model, api_key)
    ours = claude_env(url, model, api_key)
    block = {k: v for k, v in env.items() if k in ours or (k in ("NO_PROXY", "no_proxy") and _is_loopback(url))}
    block.update({k: "" for k in environ if is_provider_variable(k)})
    return {"env": dict(sorted(block.items()))}


def run(args: argparse.Namespace) -> int:
    url = base_url(args)
    api_key = api_key_from(args)
    if args.print_settings:
        print(json.dumps(settings_block(os.environ, url, args.model or served_model(url, api_key), api_key), indent=2))
        print("tandem: save it as .claude/settings.local.json in your project"
              + (" (it holds the server's API key: keep it private)" if api_key else ""), file=sys.stderr)
        return 0
    if args.print_env:  # what the child would get, as changes to this shell's environment
        env = child_env(os.environ, url, args.model or served_model(url, api_key), api_key)
        for key, value in env.items():
            if os.environ.get(key) != value:
                print(f"export {key}={shlex.quote(value)}")
        for key in sorted(set(os.environ) - set(env)):
            print(f"unset {key}")
        return 0
    exe = shutil.which(args.claude)
    if exe is None:
        raise TandemError(f"'{args.claude}' is not on PATH: install Claude Code (npm install -g @anthropic-ai/claude-code) "
                          "or pass its path with --claude; 'tandem claude --print-env' prints the variables instead")
    check_settings(settings_files(), url)
    model = args.model or served_model(url, api_key)
    env = child_env(os.environ, url, model, api_key)
    rest = args.claude_args[1:] if args.claude_args[:1] == ["--"] else args.claude_args
    print(f"tandem: starting Claude Code against {url} (model {model})", file=sys.stderr, flush=True)
    proc = subprocess.Popen([exe, *rest], env=env)
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # the terminal sent SIGINT to claude too; let it decide
            continue
