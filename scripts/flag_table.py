"""The flag table of docs/configuration.md, made from `antiphon serve`'s parser.

    python scripts/flag_table.py            # print the table
    python scripts/flag_table.py --write    # rewrite it in docs/configuration.md
    python scripts/flag_table.py --check    # exit 1 when the docs differ from the parser

Each argument group of the parser (engine, server) is one table: flag, default (the words of
--help), meaning (the flag's help).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from frontend.cli_options import serve_parser, shown_default  # noqa: E402

DOC = ROOT / "docs" / "configuration.md"
START, END = "<!-- flags:start -->", "<!-- flags:end -->"

# What reads as code in the docs: source files, flags, $VARIABLES, snake_case names (error
# codes, request fields) and URL paths; "docs/x.md" becomes a link, the docs being in that folder.
_CODE = re.compile(r"\b[a-z_]+/[\w/]+\.py\b|--[a-z0-9-]+|\$[A-Z_]+|\b[a-z0-9]+(?:_[a-z0-9]+)+\b"
                   r"|(?<![\w.:/])/[a-z0-9_/.-]*[a-z0-9]")
_DOC_LINK = re.compile(r"\bdocs/([\w-]+\.md)\b")


def markdown(text: str) -> str:
    text = _CODE.sub(lambda m: f"`{m.group()}`", text.replace("|", "\\|"))
    return _DOC_LINK.sub(r"[\1](\1)", text)


def flag_table(parser: argparse.ArgumentParser) -> str:
    parts = []
    # argparse names no public way to walk its groups; sphinx-argparse reads these too.
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.help is not argparse.SUPPRESS and a.dest != "help"]
        if not actions:
            continue
        parts.append(f"**{group.title}**: {markdown(group.description or '')}\n\n"
                     "| flag | default | meaning |\n|---|---|---|\n")
        for action in actions:
            flag = " / ".join(f"`{name}`" for name in action.option_strings)
            if action.choices:
                flag += " " + " / ".join(f"`{choice}`" for choice in action.choices)
            parts.append(f"| {flag} | {markdown(shown_default(action))} | {markdown(action.help or '')} |\n")
        parts.append("\n")
    return "".join(parts).rstrip("\n") + "\n"


def with_table(doc: str, table: str) -> str:
    head, rest = doc.split(START + "\n", 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"rewrite the table in {DOC.relative_to(ROOT)}")
    mode.add_argument("--check", action="store_true", help="exit 1 when the docs' table differs")
    args = parser.parse_args(argv)
    table = flag_table(serve_parser())
    if not (args.write or args.check):
        print(table, end="")
        return 0
    doc = DOC.read_text()
    wanted = with_table(doc, table)
    if args.check:
        if wanted != doc:
            print(f"{DOC.relative_to(ROOT)}: the flag table differs from `antiphon serve`'s flags; "
                  "run python scripts/flag_table.py --write", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
