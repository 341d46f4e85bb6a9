"""``tandem serve``: OpenAI and Anthropic compatible APIs on one local port (``engine.serve``)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from engine.errors import TandemError
from engine.generate import MODES
from engine.options import (add_model_arguments, add_prefix_cache_arguments, add_sampling_arguments,
                            check_prefix_cache_arguments, load_engine, parse_max_draft, warm_up)
from engine.batching import DEFAULT_MAX_BATCH
from engine.serve.server import ServerConfig, TandemServer
from engine.serve.worker import DEFAULT_MAX_QUEUE


API_KEY_ENV = "TANDEM_API_KEY"


def add_api_key_arguments(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--api-key", default=None,
                   help=f"{what} (visible to other local users in ps: prefer ${API_KEY_ENV} or --api-key-file)")
    p.add_argument("--api-key-file", default=None, metavar="PATH", help="read the key from this file (one line)")


def _key_file_lines(path: str) -> list[str]:
    try:
        lines = Path(path).expanduser().read_text(encoding="utf-8").strip().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or e
        raise TandemError(f"cannot read --api-key-file {path}: {reason}") from None
    return [line.strip() for line in lines if line.strip()]


def api_key_from(args: argparse.Namespace) -> str | None:
    """The key from --api-key, --api-key-file or $TANDEM_API_KEY (in that order); None if none."""
    if args.api_key and args.api_key_file:
        raise TandemError("give --api-key or --api-key-file, not both")
    if args.api_key_file:
        lines = _key_file_lines(args.api_key_file)
        if len(lines) != 1:
            raise TandemError(f"--api-key-file {args.api_key_file} must hold the key on one line")
        return lines[0]
    if args.api_key:
        print(f"tandem: note: --api-key is visible to other users of this machine (ps); ${API_KEY_ENV} or "
              "--api-key-file keep it private", file=sys.stderr)
    # Spaces around a key (a quoted export, a pasted line) are never part of it: clients strip them too.
    return (args.api_key or os.environ.get(API_KEY_ENV) or "").strip() or None


def api_keys_from(args: argparse.Namespace) -> tuple[str, ...]:
    """The server's keys: those of --api-key-file, one a line (a key per client: each drafts from
    its own history of earlier requests), else ``api_key_from``'s one; () for none."""
    if args.api_key_file and not args.api_key:
        lines = _key_file_lines(args.api_key_file)
        if not lines:
            raise TandemError(f"--api-key-file {args.api_key_file} holds no key")
        return tuple(lines)
    key = api_key_from(args)
    return (key,) if key else ()


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8080)
    add_api_key_arguments(p, "require this key on every route but /health "
                             "(Authorization: Bearer KEY or x-api-key: KEY); --api-key-file may list several, "
                             "one a line, and each key's requests draft only from that key's earlier requests")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="also answer requests whose Host is NAME (a reverse proxy's or a LAN name; '*': any). "
                        "Always answered: IP addresses, localhost, the --host name, and with --host 0.0.0.0 this "
                        "machine's host names")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="serve browser requests from this web origin (e.g. http://localhost:3000; '*': any), "
                        "with CORS headers; by default requests from web pages are refused")
    p.add_argument("--allow-image-urls", action="store_true",
                   help="fetch http(s) image URLs that requests name (off: images come as data URLs / base64, "
                        "so a web page cannot make the server fetch what it names)")
    p.add_argument("--mode", default="auto", choices=MODES, help="decoding mode when a request names none")
    p.add_argument("--max-draft", type=parse_max_draft, default=None,
                   help="draft cap per round: an integer, 0 for the drafter's full block, or 'auto' "
                        "(default: 'auto' under --mode auto, else the mode's calibrated cap)")
    add_sampling_arguments(p)
    add_prefix_cache_arguments(p)
    p.add_argument("--max-tokens", type=int, default=1024, dest="default_max_tokens",
                   help="max new tokens when a request does not say (default 1024)")
    p.add_argument("--max-context", type=int, default=None,
                   help="refuse prompts longer than this (default: the model's max_position_embeddings)")
    p.add_argument("--served-name", default=None, help="the model name /v1/models reports (default: the model's)")
    p.add_argument("--keepalive", type=float, default=10.0, help="seconds between SSE keep-alives while waiting")
    p.add_argument("--max-batch", type=int, default=None, metavar="N",
                   help="requests decoding together, each speculating on its own (default: the widest batch this "
                        f"machine's calibration of the model shows paying, else {DEFAULT_MAX_BATCH}; 1: one at a time)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE, metavar="N",
                   help=f"requests waiting for the engine before new ones get 503 (default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--no-thinking", action="store_true",
                   help="enable_thinking=false for chat templates with the switch, unless a request asks otherwise")
    p.add_argument("--quiet", action="store_true", help="do not log each request")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if (args.max_batch is not None and args.max_batch < 1) or args.max_queue < 1:
        raise TandemError(f"--max-batch and --max-queue must be at least 1, got {args.max_batch} and {args.max_queue}")
    if args.default_max_tokens < 1:
        raise TandemError(f"--max-tokens must be at least 1, got {args.default_max_tokens}")
    if args.seed is not None and not 0 <= args.seed < 2**64:
        raise TandemError(f"--seed must be between 0 and {2**64 - 1}, got {args.seed}")
    check_prefix_cache_arguments(args)
    api_key = api_keys_from(args)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        print(f"tandem: warning: listening on {args.host} without --api-key: anyone who can reach this "
              "machine can use the model", file=sys.stderr)
    config = ServerConfig(mode=args.mode, max_draft=args.max_draft, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, default_max_tokens=args.default_max_tokens,
                          max_context=args.max_context, keepalive_s=args.keepalive, model_name=args.served_name,
                          allow_hosts=tuple(args.allow_host), allow_origins=tuple(args.allow_origin),
                          max_batch=args.max_batch, max_queue=args.max_queue,
                          allow_image_urls=args.allow_image_urls, thinking=False if args.no_thinking else None,
                          calibrate_while_idle=True)

    # Shapes are compiled before the first request; --max-draft auto's calibration is measured
    # while the server is idle (engine/serve/worker.py), so no request waits for it.
    server = TandemServer(lambda: warm_up(load_engine(args), [args.mode], args.max_batch), args.host, args.port,
                          api_key, config)

    def on_term(signum: int, frame: Any) -> None:  # a service manager's stop: same clean exit as Ctrl-C
        raise KeyboardInterrupt()

    signal.signal(signal.SIGTERM, on_term)
    server.start()
    print(f"tandem: loading {args.model or 'the starter model'} ...", file=sys.stderr, flush=True)
    try:
        server.wait_ready()
        for note in getattr(server.worker.engine, "notes", []):
            print(f"tandem: {note}", file=sys.stderr)
        ctx = server.max_context
        print(f"tandem: serving {server.model_name} (mode {args.mode}, context {ctx or 'unknown'}) at {server.url}\n"
              f"  OpenAI:    {server.url}/v1/chat/completions   (base_url={server.url}/v1)\n"
              f"  Anthropic: {server.url}/v1/messages           (base_url={server.url})\n"
              f"  telemetry: {server.url}/events  {server.url}/metrics\n"
              f"  Ctrl-C stops the server.", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("\ntandem: stopping", file=sys.stderr)
        return 0
    finally:
        server.stop()
