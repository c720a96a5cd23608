"""Write the tables of BENCHMARKS.md, README.md and docs/ from the records in benchmarks/results/.

    python benchmarks/render.py            # rewrite every table from its record
    python benchmarks/render.py --check    # exit 1 when a table differs from its record (CI)

A table is a block between two markers; the first names its record and may pick columns and rows:

    <!-- record: quality-minilm columns=label,mib,english rows=kind:comera -->
    | model | MiB | english |
    ...
    <!-- /record -->

(``rows=key:a|b`` keeps the rows whose key is any of the values; ``None`` picks an empty cell.)

Under each table the block states the record's machine, date, versions, the command that
reproduces it and the commit it was measured on. A figure in prose cites one cell of a record, and
the renderer writes the cell between the two comments:

    MiniLM at `--ratio 4` keeps <!-- value: quality-minilm label="--ratio 4" english.value -->0.916<!-- /value -->

(``KEY=VALUE`` pairs pick the one row, the last word the column; ``.value`` or ``.error`` one part of a
figure with its error). A table of figures outside a record block (in BENCHMARKS.md and
docs/findings.md any table; in README.md and the other docs a table with a decimal figure) fails the
check, and so does a figure in prose outside a value reference: a decimal with two places or more
(0.93), a decimal with a unit (1.3x, 2.4 GiB, 5.2 s) or a whole number of bytes or seconds (12 s).
Whole-number counts (4x, 30 minutes, 5 %), versions and anything written as code are not figures:
a setting is written as code (`--ratio 4`, `0.05`). Words that rank two routes ("level with", "ahead
of", "beyond the peer") come from a comparison of cells measured in three runs or more of each route
(``record.runs_cell``); the renderer writes "level with" where their means ± standard deviations
overlap, else "ahead of" or "behind":

    route a runs <!-- compare: NAME route=a speed vs route=b speed -->level with<!-- /compare --> route b

The check also fails on a record that names no commit, or one this repository's history lacks, and
on a record measured since ``record.SHIPPED_INPUTS_SINCE`` whose command reads a file that does not
ship (older ones say so in their caption).
"""

from __future__ import annotations

import argparse
import math
import re
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import (  # noqa: E402
    RESULTS, RecordError, check_history, held_to_shipped_inputs, load, unshipped_inputs,
)

ROOT = Path(__file__).resolve().parent.parent
START = re.compile(r"^<!-- record: (?P<spec>[^>]*?) -->$")
END = "<!-- /record -->"
# A measured figure in a table: a share or a time with two or more decimals (0.93), or a speed-up
# with decimals (2.13x); versions (2.14.1, <2.15) and constants with one decimal (0.3) are not.
FIGURE = re.compile(r"(?<![\w.<>=~])\d+\.\d{2,}(?![\d.])|(?<![\w.])\d+\.\d+x\b")
VALUE = re.compile(r"<!-- value: (?P<spec>[^>]*?) -->(?P<shown>.*?)<!-- /value -->")
COMPARE = re.compile(r"<!-- compare: (?P<spec>[^>]*?) -->(?P<shown>.*?)<!-- /compare -->")
# Words that rank two routes: prose uses them only inside a comparison reference, which derives the word
# from three runs or more of each (COMPARE).
CLAIM = re.compile(r"\b(?:level\s+with|(?:draws?|drew|runs?|ran|ends?|ended|stays?|stayed)\s+level|ahead\s+of"
                   r"|beyond\s+the\s+peer)\b", re.IGNORECASE)
RUNS_NEEDED = 3
# A measured figure in prose: besides FIGURE's, a decimal with any unit and a whole number of bytes or
# seconds. Whole numbers before x, % or minutes are counts and settings (`--ratio 4` is 4x).
UNIT = (r"(?:x\b|×|%|times\b|percent\b|points\b|tokens\b|GHz\b|[KMGT]i?B\b|kB\b|ms\b|s\b|seconds\b|min\b"
        r"|minutes\b|hours?\b|sentences/s\b|tokens/s\b)")
PROSE_FIGURE = re.compile(rf"(?<![\w.<>=~/#-])(?:\d+\.\d+\s?{UNIT}|\d+\.\d{{2,}}(?![\d.])"
                          rf"|\d+\s?(?:[KMGT]i?B\b|kB\b|ms\b|s\b|seconds\b|sentences/s\b|tokens/s\b))")
# What prose holds that is no figure: code, comments, link targets, tags, addresses and versions.
NOT_PROSE = re.compile(r"`[^`]*`|<!--.*?-->|\]\([^)]*\)|<[^>]*>|https?://\S+"
                       r"|\b(?:[Pp]ython|torch|transformers|onnxruntime|OpenVINO|openvino|optimum[-\w]*|NNCF|nncf"
                       r"|sentence-transformers|tensorly|numpy|safetensors|hqq)\s+v?\d+(?:\.\d+)+")


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


def spread_format(error: float) -> str:
    """A figure with its spread and no column format: to the spread's second significant digit (1.243 ±
    0.081, 118.2 ± 3.1), at most three decimals."""
    if not error:
        return ".3f"
    return f".{min(3, max(0, 1 - math.floor(math.log10(abs(error)))))}f"


def format_cell(value, spec: str | None = None) -> str:
    """A cell as the table shows it: numbers by the column's format (``.3f``), a figure and its
    standard error as ``0.916 ± 0.031``, nothing measured as an empty cell."""
    if value is None:
        return ""
    if isinstance(value, dict):
        spec = spec or spread_format(value["error"])
        return f"{format_cell(value['value'], spec)} ± {format_cell(value['error'], spec)}"
    if isinstance(value, (int, float)) and spec:
        return format(value, spec)
    if isinstance(value, float):
        return f"{value:g}" if abs(value) >= 1000 else repr(value)
    text = str(value).replace("|", "\\|")
    if text.startswith("--") and "`" not in text:  # command-line options read as code
        return f"`{text}`"
    return text


def caption(record: dict, root: Path = ROOT) -> str:
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
    unshipped = unshipped_inputs(record, root)
    if unshipped:
        text += f"; it read files that do not ship ({', '.join(unshipped)}), so it does not rerun from a checkout"
    return text + f" (record `benchmarks/results/{record['name']}.json`).*"


def parse_value_spec(spec: str, where: str) -> tuple[str, dict, str]:
    """``NAME KEY=VALUE ... COLUMN`` -> (NAME, the row's {KEY: VALUE}, COLUMN); values may be quoted."""
    try:
        name, *words = shlex.split(spec)
    except ValueError as err:
        raise RecordError(f"{where}: cannot read the value reference {spec!r} ({err})") from None
    if not words or "=" in words[-1]:
        raise RecordError(f"{where}: the value reference {spec!r} names no column (expected NAME KEY=VALUE COLUMN)")
    selector = dict(word.split("=", 1) for word in words[:-1] if "=" in word)
    if len(selector) != len(words) - 1:
        raise RecordError(f"{where}: the value reference {spec!r} should pick its row with KEY=VALUE pairs")
    return name, selector, words[-1]


def render_value(record: dict, selector: dict, column: str) -> str:
    """The one cell of ``record`` that ``selector`` and ``column`` pick, as its table shows it."""
    name = record["name"]
    key, _, part = column.partition(".")
    by_key = {each["key"]: each for each in record["columns"]}
    if key not in by_key or part not in ("", "value", "error"):
        raise RecordError(f"record {name!r} has no column {column!r} (it has {', '.join(by_key)})")
    cell = picked_cell(record, selector, key)
    if part and isinstance(cell, dict):
        cell = cell[part]
    elif part == "error":
        raise RecordError(f"record {name!r}: {key!r} has no error in the row picked")
    return format_cell(cell, by_key[key].get("format"))


def picked_cell(record: dict, selector: dict, key: str):
    """The cell of ``record``'s one row that ``selector`` picks, in column ``key``."""
    rows = [row for row in record["rows"] if all(str(row.get(k)) == v for k, v in selector.items())]
    if len(rows) != 1:
        wanted = " ".join(f"{k}={v!r}" for k, v in selector.items())
        raise RecordError(f"record {record['name']!r} has {len(rows)} rows with {wanted or 'no selector'} "
                          f"(a reference cites one)")
    return rows[0].get(key)


def comparison_word(record: dict, first: tuple[dict, str], second: tuple[dict, str]) -> str:
    """How the first route stands to the second in one column of ``record``, from their repeated runs:
    "level with" where mean ± standard deviation overlap, else "ahead of" (higher) or "behind"."""
    cells = [picked_cell(record, selector, key) for selector, key in (first, second)]
    for (selector, key), cell in zip((first, second), cells):
        runs = len(cell.get("runs", ())) if isinstance(cell, dict) else 1
        if runs < RUNS_NEEDED:
            wanted = " ".join(f"{k}={v!r}" for k, v in selector.items())
            raise RecordError(f"record {record['name']!r}: {key!r} of {wanted} rests on {runs} run(s); a claim "
                              f"of level or ahead needs {RUNS_NEEDED} or more of each route")
    (mean_a, sd_a), (mean_b, sd_b) = ((cell["value"], cell["error"]) for cell in cells)
    if abs(mean_a - mean_b) <= sd_a + sd_b:
        return "level with"
    return "ahead of" if mean_a > mean_b else "behind"


def parse_compare_spec(spec: str, where: str) -> tuple[str, tuple[dict, str], tuple[dict, str]]:
    """``NAME KEY=VALUE ... COLUMN vs KEY=VALUE ... COLUMN`` -> (NAME, (row, column), (row, column))."""
    name, _, rest = spec.partition(" ")
    first, sep, second = rest.partition(" vs ")
    if not sep:
        raise RecordError(f"{where}: the comparison {spec!r} should read NAME KEY=VALUE COLUMN vs KEY=VALUE COLUMN")
    sides = []
    for side in (first, second):
        _, selector, column = parse_value_spec(f"{name} {side}", where)
        sides.append((selector, column))
    return name, sides[0], sides[1]


def render_values(line: str, where: str, results: Path, changed: list[str]) -> str:
    """``line`` with each value reference's cell, and each comparison's word, written afresh from its record."""
    def rewriter(kind: str, parse, show):
        def rewrite(match: re.Match) -> str:
            name, *picked = parse(match.group("spec"), where)
            try:
                shown = show(load(name, results), *picked)
            except RecordError as err:
                raise RecordError(f"{where}: {err}") from None
            if shown != match.group("shown") and name not in changed:
                changed.append(name)
            return f"<!-- {kind}: {match.group('spec')} -->{shown}<!-- /{kind} -->"
        return rewrite

    line = COMPARE.sub(rewriter("compare", parse_compare_spec, comparison_word), line)
    return VALUE.sub(rewriter("value", parse_value_spec, render_value), line)


def render_table(record: dict, options: dict, root: Path = ROOT) -> list[str]:
    """The Markdown lines of ``record``'s table with the columns and rows ``options`` pick; the caption names the
    files its command reads that the checkout at ``root`` lacks."""
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
        wanted = value.split("|")
        rows = [row for row in rows if str(row.get(key)) in wanted]
        if not rows:
            raise RecordError(f"record {name!r} has no row with {key} = {' or '.join(map(repr, wanted))}")
    lines = ["| " + " | ".join(column["header"] for column in columns) + " |",
             "|" + "---|" * len(columns)]
    for row in rows:
        cells = (format_cell(row[column["key"]], column.get("format")) for column in columns)
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for note in record.get("notes", []):
        lines += [note, ""]
    lines.append(caption(record, root))
    return lines


def render_document(path: Path, results: Path = RESULTS) -> tuple[str, list[str]]:
    """``path``'s text with every record block written afresh from its record, and the names of the
    records whose tables changed."""
    lines = path.read_text().split("\n")
    out, index, changed = [], 0, []
    while index < len(lines):
        line = lines[index]
        match = START.match(line)
        where = f"{path.name} line {index + 1}"
        if not match:
            out.append(render_values(line, where, results, changed))
            index += 1
            continue
        end = next((i for i in range(index + 1, len(lines)) if lines[i] == END), None)
        if end is None:
            raise RecordError(f"{where}: the record block has no closing {END}")
        name, options = parse_spec(match.group("spec"), where)
        table = render_table(load(name, results), options, results.parents[1])  # results: ROOT/benchmarks/results
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


def claims_in(paragraph: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """The words of ``paragraph`` (its lines' numbers and prose) that rank two routes, with their line, also
    where a line break splits them."""
    text, starts = "", []
    for number, prose in paragraph:
        starts.append((len(text), number))
        text += prose + " "
    return [(max(number for start, number in starts if start <= match.start()), match.group(0))
            for match in CLAIM.finditer(text)]


def figures_outside_records(path: Path, text: str) -> list[str]:
    """Where ``text``'s prose states a figure that neither a record block nor a value reference writes, or
    ranks two routes outside a comparison reference."""
    problems, inside, fenced, paragraph = [], False, False, []
    for number, line in enumerate(text.split("\n") + [""], start=1):
        if START.match(line) or line == END:
            inside = line != END
        elif line.lstrip().startswith("```"):
            fenced = not fenced
        elif not (inside or fenced or not line.strip()):
            prose = NOT_PROSE.sub(" ", COMPARE.sub(" ", VALUE.sub(" ", line)))
            if line.startswith("|"):  # a hand-written table's row: its figures are tables_outside_records' to judge
                problems += unranked_claims(path, [(number, prose)])
            else:
                paragraph.append((number, prose))
                for match in PROSE_FIGURE.finditer(prose):
                    problems.append(f"{path.name} line {number}: the figure {match.group(0).strip()!r} is in no "
                                    f"record (cite it with <!-- value: RECORD KEY=VALUE COLUMN -->, or write a "
                                    f"setting as code)")
                continue
        problems += unranked_claims(path, paragraph)
        paragraph = []
    return sorted(problems, key=lambda problem: int(problem.split(" line ", 1)[1].split(":", 1)[0]))


def unranked_claims(path: Path, paragraph: list[tuple[int, str]]) -> list[str]:
    """A line for each word of ``paragraph`` that ranks two routes outside a comparison reference."""
    return [f"{path.name} line {at}: {words!r} ranks two routes without their runs (derive it with "
            f"<!-- compare: RECORD KEY=VALUE COLUMN vs KEY=VALUE COLUMN --> from {RUNS_NEEDED} runs of "
            f"each, or state the figures)" for at, words in claims_in(paragraph)]


def unshipped_problems(record: dict, root: Path) -> list[str]:
    """A record measured since SHIPPED_INPUTS_SINCE whose command reads files a checkout lacks: one line."""
    unshipped = unshipped_inputs(record, root)
    if not unshipped or not held_to_shipped_inputs(record):
        return []
    return [f"benchmarks/results/{record['name']}.json: the command reads {', '.join(unshipped)}, which a checkout "
            f"does not hold: make inputs with a shipped script under --work, or ship them"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a table differs")
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    results = args.root / "benchmarks" / "results"
    problems = []
    try:
        for path in sorted(results.glob("*.json")):
            measured = load(path.stem, results)
            check_history(measured, args.root)
            problems += unshipped_problems(measured, args.root)
        for path in documents(args.root):
            if not path.is_file():
                continue
            text = path.read_text()
            rendered, changed = render_document(path, results)
            problems += tables_outside_records(path, rendered) + figures_outside_records(path, rendered)
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
