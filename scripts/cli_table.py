"""docs/cli.md, the table of every flag, generated from `nanoareal.py --help` (the same parser
and help text).

    python scripts/cli_table.py            # print the table
    python scripts/cli_table.py --write    # rewrite docs/cli.md

tests/test_cli_docs.py fails when docs/cli.md differs from this output, so a new or changed flag
cannot leave the docs behind.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import nanoareal  # noqa: E402

DOC = ROOT / "docs" / "cli.md"
HEADER = ("# Every flag\n\nGenerated from `python nanoareal.py --help` by "
          "`python scripts/cli_table.py --write`; a test keeps it current. A flag marked in the "
          "code as volatile (how a run is watched or how long it goes) can change on a rerun "
          "without starting another run.\n\n")


def sections() -> list[tuple[str, list[str]]]:
    """(section name, field names) in --help order: each config class's `# name` comments."""
    out: list[tuple[str, list[str]]] = []
    classes = [c for c in reversed(nanoareal.Config.__mro__) if dataclasses.is_dataclass(c)]
    for cls in classes:
        own = {f.name for f in dataclasses.fields(cls)} - {n for _, names in out for n in names}
        for line in inspect.getsource(cls).splitlines():
            if m := re.fullmatch(r"    # (\w[\w ]*)", line):
                out.append((m.group(1), []))
            elif (m := re.match(r"    (\w+):", line)) and m.group(1) in own:
                out[-1][1].append(m.group(1))
    return [(name, fields) for name, fields in out if fields]


def flag_help() -> dict[str, tuple[str, str, str]]:
    """field name -> (flag spelling, default, help sentence) from tyro's parser."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import tyro

        parser = tyro.extras.get_parser(nanoareal.Config)
    out = {}
    for action in parser._actions:
        flags = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
        if not flags:
            continue
        name = flags[0][2:].replace("-", "_")
        m = re.fullmatch(r"(.*)\s*\(default: (.*?)\)", " ".join((action.help or "").split()))
        text, default = (m.group(1), m.group(2)) if m else ((action.help or "").strip(), "")
        out[name] = (" / ".join(f"`{f}`" for f in flags), default, text.strip())
    return out


def markdown_table() -> str:
    helps = flag_help()
    rows = ["| flag | default | what it does |", "|---|---|---|"]
    for section, names in sections():
        rows.append(f"| **{section}** | | |")
        for name in names:
            flag, default, text = helps[name]
            default = "—" if default in ("None", "") else f"`{default}`"
            rows.append(f"| {flag} | {default} | {text.replace('|', '/')} |")
    return "\n".join(rows)


def document() -> str:
    return HEADER + markdown_table() + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help="rewrite docs/cli.md")
    if not p.parse_args().write:
        print(markdown_table())
        return
    old = DOC.read_text() if DOC.exists() else ""
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(document())
    print(f"{DOC.relative_to(ROOT)}: " + ("already up to date" if old == document() else "updated"))


if __name__ == "__main__":
    main()
