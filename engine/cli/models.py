"""``tandem models``: the built-in models and the target -> drafter registry."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Iterable

from engine.registry import OWN_HEAD, available, base_name, registry_path, rows, rows_for


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="show only the registry rows this model name matches; when it is on this machine, also "
                        "load it and show which modes it runs (or why it runs baseline)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _status(row: dict) -> str:
    if row.get("supported", True) is False:
        return "unsupported"
    if row["drafter"] == OWN_HEAD:
        return "in model"  # the checkpoint's own MTP head: there when the original checkpoint is
    return "yes" if available(row) else "no"


def _table(headers: list[str], body: Iterable[list[str]]) -> str:
    body = [list(map(str, r)) for r in body]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in body)])


def builtin_models() -> list[dict]:
    try:
        from engine.starter import list_builtin_models
    except ImportError:
        return []
    return list_builtin_models()


def local_model_rows(spec: str) -> list[tuple[str, str]] | None:
    """The loaded model's caches and modes (engine.doctor.model_rows), or None when it is not on
    this machine."""
    from engine.errors import TandemError
    from engine.loading import resolve_model_path

    try:
        resolve_model_path(spec)
    except TandemError:
        return None
    from engine.api import load
    from engine.doctor import model_rows

    return model_rows(load(spec))


def run(args: argparse.Namespace) -> int:
    selected = rows_for(args.model) if args.model else rows()
    table = [dict(row, base_name=base_name(row["target"]), local=_status(row)) for row in selected]
    builtins = [] if args.model else builtin_models()
    here = local_model_rows(args.model) if args.model else None
    if args.json:
        out = {"builtin": builtins, "registry": table}
        if here is not None:
            out["model"] = dict(here)
        print(json.dumps(out, indent=2))
        return 0
    if here is not None:
        width = max(len(label) for label, _ in here)
        print("\n".join(f"{label:<{width}}  {value}" for label, value in here) + "\n")
    if builtins:
        print("Built-in models (work offline once installed):")
        print(_table(["name", "model", "installed", "about"],
                     [[m["name"] + (" (default)" if m.get("default") else ""), m["display_name"],
                       "yes" if m["installed"] else "no", m["description"]] for m in builtins]))
        print()
    if args.model and not table:
        print(f"No registered drafter for {args.model} (base name '{base_name(args.model)}'); --mode auto uses lookup.")
        return 0
    print(f"Drafter registry ({registry_path()}):")
    print(_table(["target", "base-name match", "mode", "drafter", "local", "auto"],
                 [[r["target"], r["base_name"], r["mode"], r["drafter"], r["local"],
                   "yes" if r.get("auto", True) else "no"] for r in table]))
    print("\nlocal: 'yes' = bundled or in the local Hugging Face cache (never downloaded automatically); 'in model' = "
          "the target checkpoint's own MTP head (mlx-community conversions strip it).", file=sys.stdout)
    print("auto: 'no' = used by its --mode, passed over by --mode auto:")
    for r in table:
        if not r.get("auto", True):
            print(f"  {r['target']} ({r['mode']}): {r.get('why', 'measured slower than lookup')}")
    return 0
