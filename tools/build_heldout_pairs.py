"""Query/document pairs of two domains the project never reads, from what a Debian machine carries,
for `comera eval --pairs`, `comera bench --pairs` and `benchmarks/quality.py` (BENCHMARKS.md, How to read
the figures), and the package's own held-out english pairs as a file beside them:

  man.jsonl      a man page's one-line summary (NAME) against the first paragraph of its DESCRIPTION
  debian.jsonl   an installed Debian package's short description against its long one
  english.jsonl  a held-out passage of the built-in english corpus: its first sentence against the rest
                 (the pairs `comera eval` scores english by)

    python tools/build_heldout_pairs.py OUT_DIR [--count 1000]

Deterministic for a given machine: pages and packages in name order, every query and every
document once. Neither calibration nor training reads these sources.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path

MIN_DOCUMENT_CHARS = 80
MAX_DOCUMENT_CHARS = 1200
MIN_QUERY_CHARS = 12
TROFF_ESCAPES = [(r"\\f(\[[A-Z]*\]|\(..|.)", ""), (r"\\\(em|\\\(en", "-"), (r"\\-", "-"), (r"\\&|\\:|\\c", ""),
                 (r"\\e", "\\\\"), (r"\\\(aq", "'"), (r"\\\((lq|rq|dq)", '"'), (r"\\ ", " "), (r"\\[*s]\S*", "")]
TEXT_MACROS = re.compile(r"^\.(B|I|BR|RB|IR|RI|BI|IB|SM|SB)\s+(.*)$")
PARAGRAPH_MACROS = re.compile(r"^\.(PP|P|LP|TP|IP|HP|sp|br|RS|RE|nf|fi|TQ|in|ti|SS|Sh|Pp|Bl|El|It)\b")


def untroff(line: str) -> str:
    for pattern, replacement in TROFF_ESCAPES:
        line = re.sub(pattern, replacement, line)
    return line


def man_sections(text: str) -> dict[str, list[str]]:
    sections, current = {}, None
    for line in text.splitlines():
        header = re.match(r'^\.S[Hh]\s+"?([^"]*)"?', line)
        if header:
            current = header.group(1).strip().upper()
            sections.setdefault(current, [])
        elif current is not None:
            sections[current].append(line)
    return sections


def paragraphs(lines: list[str]) -> list[str]:
    found, words = [], []
    for line in lines:
        macro = TEXT_MACROS.match(line)
        if macro:
            line = macro.group(2).replace('"', "")
        elif line.startswith((".", "'")):
            if PARAGRAPH_MACROS.match(line) or not line[1:].strip():
                found.append(" ".join(words))
                words = []
            continue
        if not line.strip():
            found.append(" ".join(words))
            words = []
            continue
        words.extend(untroff(line).split())
    found.append(" ".join(words))
    return [p for p in found if p]


def man_pair(path: Path) -> tuple[str, str] | None:
    try:
        text = gzip.decompress(path.read_bytes()).decode("utf-8") if path.suffix == ".gz" else path.read_text()
    except (OSError, UnicodeDecodeError, EOFError, gzip.BadGzipFile):
        return None
    if text.lstrip().startswith(".so"):
        return None  # an alias of another page
    sections = man_sections(text)
    name = " ".join(untroff(line) for line in sections.get("NAME", []) if not line.startswith("."))
    summary = re.split(r"\s+-+\s+", name, maxsplit=1)
    if len(summary) != 2 or len(summary[1]) < MIN_QUERY_CHARS:
        return None
    description = next((p for p in paragraphs(sections.get("DESCRIPTION", [])) if len(p) >= MIN_DOCUMENT_CHARS), None)
    return (summary[1].strip(), description[:MAX_DOCUMENT_CHARS]) if description else None


# Families of generated pages (one per subcommand of a cloud CLI) whose description repeats the
# summary word for word: thousands of near-identical, trivially matched pairs.
GENERATED_FAMILIES = ("gcloud", "bq", "gsutil")


def man_pairs() -> list[tuple[str, str]]:
    pages = sorted(p for p in Path("/usr/share/man").glob("man[1-8]/*") if not p.name.startswith(GENERATED_FAMILIES))
    return [pair for pair in map(man_pair, pages) if pair]


def debian_pairs(status: Path = Path("/var/lib/dpkg/status")) -> list[tuple[str, str]]:
    pairs = []
    for record in sorted(status.read_text(encoding="utf-8").split("\n\n")):
        match = re.search(r"^Description: (.*)\n((?: .*\n?)*)", record, re.M)
        if not match:
            continue
        long_text = [line[1:] for line in match.group(2).splitlines()]
        first = " ".join(" ".join(long_text).split(" . ")[0].split())
        if len(match.group(1)) >= MIN_QUERY_CHARS and len(first) >= MIN_DOCUMENT_CHARS:
            pairs.append((match.group(1).strip(), first[:MAX_DOCUMENT_CHARS]))
    return pairs


def english_pairs(count: int) -> list[tuple[str, str]]:
    """The built-in english corpus's held-out pairs, as `comera eval` draws them."""
    from comera_convert.retrieval import held_out_pairs

    return held_out_pairs("english", count)


def distinct(pairs: list[tuple[str, str]], count: int) -> list[tuple[str, str]]:
    """Up to ``count`` pairs spread evenly over ``pairs`` (not its first ones: name order would
    favour a few prefixes), each query and each document once."""
    queries, documents, kept = set(), set(), []
    for query, document in pairs:
        if query not in queries and document not in documents:
            queries.add(query)
            documents.add(document)
            kept.append((query, document))
    step = max(1, len(kept) // count)
    return kept[::step][:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--count", type=int, default=1000)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, pairs in (("man", man_pairs()), ("debian", debian_pairs()), ("english", english_pairs(args.count))):
        chosen = distinct(pairs, args.count)
        with open(args.out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for query, document in chosen:
                f.write(json.dumps({"query": query, "document": document}) + "\n")
        print(f"{name}: {len(chosen)} pairs")


if __name__ == "__main__":
    main()
