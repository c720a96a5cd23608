"""Write the tables of BENCHMARKS.md, README.md and docs/ from the records in benchmarks/results/.

    python benchmarks/render.py            # rewrite every table from its record
    python benchmarks/render.py --check    # exit 1 when a table differs from its record (CI)

A table is a block between two markers; the first names its record and may pick columns and rows:

    <!-- record: quality-minilm columns=label,mib,english rows=kind:comera -->
    | model | MiB | english |
    ...
    <!-- /record -->

Under each table the block states the record's machine, date, versions, the command that
reproduces it and the commit it was measured on. A table of figures outside such a block (in
BENCHMARKS.md and docs/findings.md any table; in README.md and the other docs a table with a decimal
figure) fails the check: every published figure comes from a record. So does a record that names no
commit, or one this repository's history lacks.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import RESULTS, RecordError, check_history, load  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
START = re.compile(r"^<!-- record: (?P<spec>[^>]*?) -->$")
END = "<!-- /record -->"
# A measured figure in a table: a share or a time with two or more decimals (0.93), or a speed-up
# with decimals (2.13x); versions (2.14.1, <2.15) and constants with one decimal (0.3) are not.
FIGURE = re.compile(r"(?<![\w.<>=~])\d+\.\d{2,}(?![\d.])|(?<![\w.])\d+\.\d+x\b")


def documents(root: Path = ROOT) -> list[Path]:
    """The files whose tables come from records."""
    return [root / "BENCHMARKS.md", root / "README.md", *sorted((root / "docs").glob("*.md"))]


def every_table_is_a_record(path: Path) -> bool:
    """BENCHMARKS.md and the findings page hold nothing but measured tables."""
    return path.name in ("BENCHMARKS.md", "findings.md")


def parse_spec(spec: str, where: str) -> tuple[str, dict]:
    """``NAME key=value ...`` -> (NAME, {key: value}); keys: columns, rows."""
    name, *options = spec.split()
    chosen = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in ("columns", "rows"):
            raise RecordError(f"{where}: unknown marker option {option!r} (expected columns=a,b or rows=key:value)")
        chosen[key] = value
    return name, chosen


def format_cell(value, spec: str | None = None) -> str:
    """A cell as the table shows it: numbers by the column's format (``.3f``), a figure and its
    standard error as ``0.916 ± 0.031``, nothing measured as an empty cell."""
    if value is None:
        return ""
    if isinstance(value, dict):
        return f"{format_cell(value['value'], spec)} ± {format_cell(value['error'], spec)}"
    if isinstance(value, (int, float)) and spec:
        return format(value, spec)
    if isinstance(value, float):
        return f"{value:g}" if abs(value) >= 1000 else repr(value)
    text = str(value).replace("|", "\\|")
    if text.startswith("--") and "`" not in text:  # command-line options read as code
        return f"`{text}`"
    return text


def caption(record: dict) -> str:
    machine, versions = record["machine"], record["versions"]
    where = machine.get("gpu") or f"{machine['cpu']}, {machine['cores']} cores"
    features = machine.get("features")
    if features and not machine.get("gpu"):
        where += f" ({', '.join(features)})"
    text = (f"*{record['date']}, {where}, torch {versions['torch']}, transformers {versions['transformers']}: "
            f"`{record['command']}`")
    if record.get("commit"):
        measured_at, _, changed = record["commit"].partition("+")
        text += f"; commit {measured_at}" + (" with uncommitted changes" if changed else "")
    if record.get("source"):
        text += f"; {record['source']}"
    return text + f" (record `benchmarks/results/{record['name']}.json`).*"


def render_table(record: dict, options: dict) -> list[str]:
    """The Markdown lines of ``record``'s table with the columns and rows ``options`` pick."""
    name = record["name"]
    columns = record["columns"]
    if "columns" in options:
        by_key = {column["key"]: column for column in columns}
        unknown = [key for key in options["columns"].split(",") if key not in by_key]
        if unknown:
            raise RecordError(f"record {name!r} has no column {unknown[0]!r} (it has {', '.join(by_key)})")
        columns = [by_key[key] for key in options["columns"].split(",")]
    rows = record["rows"]
    if "rows" in options:
        key, _, value = options["rows"].partition(":")
        rows = [row for row in rows if str(row.get(key)) == value]
        if not rows:
            raise RecordError(f"record {name!r} has no row with {key} = {value!r}")
    lines = ["| " + " | ".join(column["header"] for column in columns) + " |",
             "|" + "---|" * len(columns)]
    for row in rows:
        cells = (format_cell(row[column["key"]], column.get("format")) for column in columns)
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for note in record.get("notes", []):
        lines += [note, ""]
    lines.append(caption(record))
    return lines


def render_document(path: Path, results: Path = RESULTS) -> tuple[str, list[str]]:
    """``path``'s text with every record block written afresh from its record, and the names of the
    records whose tables changed."""
    lines = path.read_text().split("\n")
    out, index, changed = [], 0, []
    while index < len(lines):
        line = lines[index]
        match = START.match(line)
        if not match:
            out.append(line)
            index += 1
            continue
        where = f"{path.name} line {index + 1}"
        end = next((i for i in range(index + 1, len(lines)) if lines[i] == END), None)
        if end is None:
            raise RecordError(f"{where}: the record block has no closing {END}")
        name, options = parse_spec(match.group("spec"), where)
        table = render_table(load(name, results), options)
        if table != lines[index + 1:end]:
            changed.append(name)
        out += [line, *table, END]
        index = end + 1
    return "\n".join(out), changed


def tables_outside_records(path: Path, text: str) -> list[str]:
    """Where ``text`` holds a table of figures that no record block writes."""
    problems, inside, table_start, table_lines = [], False, None, []
    strict = every_table_is_a_record(path)

    def close():
        if table_start is not None and (strict or any(FIGURE.search(row) for row in table_lines)):
            problems.append(f"{path.name} line {table_start}: a table of figures with no record behind it "
                            f"(put it in a <!-- record: NAME --> block)")

    for number, line in enumerate(text.split("\n"), start=1):
        if START.match(line):
            inside = True
        elif line == END:
            inside = False
        is_row = line.startswith("|") and not inside
        if is_row and table_start is None:
            table_start, table_lines = number, []
        if is_row:
            table_lines.append(line)
        elif table_start is not None:
            close()
            table_start = None
    close()
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a table differs")
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    results = args.root / "benchmarks" / "results"
    problems = []
    try:
        for path in sorted(results.glob("*.json")):
            check_history(load(path.stem, results), args.root)
        for path in documents(args.root):
            if not path.is_file():
                continue
            text = path.read_text()
            rendered, changed = render_document(path, results)
            problems += tables_outside_records(path, rendered)
            if rendered == text:
                continue
            if args.check:
                problems += [f"{path.name}: the table of record {name!r} differs from the record: run "
                             f"python benchmarks/render.py" for name in changed]
            else:
                path.write_text(rendered)
                print(f"wrote {path.relative_to(args.root)}")
    except RecordError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
