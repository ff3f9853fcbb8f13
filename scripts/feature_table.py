"""Prints, checks or rewrites the README's feature x implementation table.

The table comes from `vidax_eqx.kernels.feature_table()`, which reads the same
capability flags that dispatch uses. In the README it sits between the lines
`<!-- feature-table:start -->` (or `<!-- feature-table:start brief -->`: without the
implementations' notes) and `<!-- feature-table:end -->`.

    python scripts/feature_table.py                    # print the table
    python scripts/feature_table.py --check README.md  # exit 1 if the README's copy is stale
    python scripts/feature_table.py --write README.md  # regenerate the README's copy
"""

import argparse
import difflib
import os
import sys


# Use this checkout's vidax_eqx, so the table always matches the code beside it.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vidax_eqx import kernels  # noqa: E402


START = "<!-- feature-table:start -->"
BRIEF = "<!-- feature-table:start brief -->"  # the table without the implementations' notes
END = "<!-- feature-table:end -->"


def split(text: str, path: str) -> tuple[str, str, str]:
    """`text` as (up to and including the start marker line, the table, from the end marker)."""
    start = text.find(START) if START in text else text.find(BRIEF)
    end = text.find(END)
    if start < 0 or end < 0 or end < start:
        raise SystemExit(
            f"{path}: the feature table must sit between a line {START!r} and a later line "
            f"{END!r}; add both markers, then run `python scripts/feature_table.py --write {path}`."
        )
    head_end = text.index("-->", start) + 3
    if text.startswith("\n", head_end):
        head_end += 1
    return text[:head_end], text[head_end:end], text[end:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="The README's feature x implementation table.")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--check", metavar="README", help="exit 1 if README's table is not current")
    group.add_argument("--write", metavar="README", help="rewrite README's table in place")
    args = p.parse_args(argv)

    if not (args.check or args.write):
        sys.stdout.write(kernels.feature_table().strip() + "\n")
        return 0

    path = args.check or args.write
    with open(path, encoding="utf-8") as f:
        text = f.read()
    head, current, tail = split(text, path)
    table = kernels.feature_table(notes=BRIEF not in head).strip() + "\n"
    if args.write:
        new = head + table + tail
        if new != text:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
            print(f"{path}: feature table updated")
        else:
            print(f"{path}: feature table already current")
        return 0

    if current.strip() == table.strip():
        print(f"{path}: feature table is current")
        return 0
    diff = difflib.unified_diff(
        current.strip().splitlines(), table.strip().splitlines(),
        f"{path} (feature table)", "kernels.feature_table()", lineterm="",
    )  # fmt: skip
    print("\n".join(diff))
    print(
        f"{path}: the feature table is out of date with the capability flags; run "
        f"`python scripts/feature_table.py --write {path}`.",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
