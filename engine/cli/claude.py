"""``tandem claude``: run Claude Code against a running ``tandem serve``.

    tandem serve &                      # in another terminal
    tandem claude [-- claude args...]   # Claude Code, answered by the local model
    tandem claude --print-env           # or: eval "$(tandem claude --print-env)"; claude

Only the environment of the one ``claude`` child process is set: ANTHROPIC_BASE_URL (the
server), ANTHROPIC_AUTH_TOKEN (the server's --api-key, else a placeholder; Claude Code sends it
as a Bearer token), ANTHROPIC_API_KEY emptied (so a real Anthropic key in your shell is not sent
to the local server), ANTHROPIC_MODEL and the small/fast and per-tier default models (all the
served model: the server answers every model name), CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC
(no telemetry or update checks to Anthropic) and API_TIMEOUT_MS (local prefill of Claude Code's
long system prompt can take minutes on a CPU). No file or setting is changed.

Claude Code's system prompt and tool list are long (tens of thousands of tokens); a model with a
small context (the starter's is 8192) answers with "prompt is too long", which the server says
plainly. A larger local model is needed for real agent work.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import urllib.error
import urllib.request

from engine.errors import TandemError

PLACEHOLDER_TOKEN = "tandem-local"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="the tandem server's host (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="the tandem server's port (default 8080)")
    p.add_argument("--url", default=None, help="the server's base URL (overrides --host/--port)")
    p.add_argument("--api-key", default=None, help="the key the server was started with (--api-key)")
    p.add_argument("--model", default=None, help="model name to ask for (default: the one the server serves)")
    p.add_argument("--print-env", action="store_true", help="print the environment as shell exports and exit")
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


def run(args: argparse.Namespace) -> int:
    url = base_url(args)
    if args.print_env:
        model = args.model or served_model(url, args.api_key)
        for key, value in claude_env(url, model, args.api_key).items():
            print(f"export {key}={shlex.quote(value)}")
        return 0
    exe = shutil.which(args.claude)
    if exe is None:
        raise TandemError(f"'{args.claude}' is not on PATH: install Claude Code (npm install -g @anthropic-ai/claude-code) "
                          "or pass its path with --claude; 'tandem claude --print-env' prints the variables instead")
    model = args.model or served_model(url, args.api_key)
    env = {**os.environ, **claude_env(url, model, args.api_key)}
    rest = args.claude_args[1:] if args.claude_args[:1] == ["--"] else args.claude_args
    print(f"tandem: starting Claude Code against {url} (model {model})", file=sys.stderr, flush=True)
    proc = subprocess.Popen([exe, *rest], env=env)
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # the terminal sent SIGINT to claude too; let it decide
            continue
