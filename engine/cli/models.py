"""``tandem models``: the built-in models and the target -> drafter registry."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Iterable

from engine.registry import available, base_name, registry_path, rows, rows_for


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="show only the registry rows this model name matches")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _status(row: dict) -> str:
    if row.get("supported", True) is False:
        return "unsupported"
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


def run(args: argparse.Namespace) -> int:
    selected = rows_for(args.model) if args.model else rows()
    table = [dict(row, base_name=base_name(row["target"]), local=_status(row)) for row in selected]
    builtins = [] if args.model else builtin_models()
    if args.json:
        print(json.dumps({"builtin": builtins, "registry": table}, indent=2))
        return 0
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
    print("\nlocal: 'yes' = bundled or in the local Hugging Face cache (never downloaded automatically).",
          file=sys.stdout)
    print("auto: 'no' = used by --mode dspark/dflash, passed over by --mode auto:")
    for r in table:
        if not r.get("auto", True):
            print(f"  {r['target']} ({r['mode']}): {r.get('why', 'measured slower than lookup')}")
    return 0
