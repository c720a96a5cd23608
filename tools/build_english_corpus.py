"""Build the built-in ``english`` corpus (comera_convert/corpora/english.jsonl.xz) from Debian packages.

Every source is in the public domain or under a permissive licence (see comera_convert/corpora/README.md).
Run once on a Debian machine; the result ships inside the package, so nothing is fetched at run time:

    apt-get install wordnet-base bible-kjv dict-devil dict-jargon fortunes r-cran-janeaustenr python3.11-doc
    python tools/build_english_corpus.py

Each source is cut into passages of about ``PASSAGE_WORDS`` words (whole paragraphs, verses, entries or
definitions), and the passages of all sources are interleaved in a fixed pseudo-random order, so that
any prefix of the corpus (what a short run reads) mixes every source in proportion to its size.
"""

from __future__ import annotations

import gzip
import json
import lzma
import random
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

PASSAGE_WORDS = 180  # about 230 BERT tokens: a passage fills at least one 128-token block
OUT = Path(__file__).resolve().parents[1] / "comera_convert" / "corpora" / "english.jsonl.xz"
SEED = 20  # the interleaving order; fixed so that the held-out split never changes


def passages(units: Iterable[str], words: int = PASSAGE_WORDS) -> Iterator[str]:
    """Consecutive units (paragraphs, verses, entries) joined until a passage holds ``words`` words."""
    current, count = [], 0
    for unit in units:
        unit = re.sub(r"[ \t]+", " ", unit).strip()
        if not unit:
            continue
        current.append(unit)
        count += len(unit.split())
        if count >= words:
            yield "\n".join(current)
            current, count = [], 0
    if current:
        yield "\n".join(current)


def austen() -> Iterator[str]:
    """Jane Austen's six novels (public domain; janeaustenr, MIT): paragraphs, chapter headings dropped."""
    with tempfile.TemporaryDirectory() as tmp:
        table = Path(tmp) / "austen.tsv"
        subprocess.run(["Rscript", "-e", "library(janeaustenr); write.table(austen_books(), "
                        f"'{table}', sep='\\t', row.names=FALSE, quote=FALSE)"], check=True)
        lines = [line.split("\t")[0] for line in table.read_text().splitlines()[1:]]
    paragraphs, current = [], []
    for line in lines + [""]:
        if line.strip():
            current.append(line.strip())
        elif current:
            paragraph = " ".join(current)
            heading = r"(CHAPTER|Chapter|VOLUME) [IVXLC\d]+\.?|[A-Z &]+|by Jane Austen|\(\d+\)"
            if not re.fullmatch(heading, paragraph):
                paragraphs.append(paragraph)
            current = []
    yield from passages(paragraphs)


def kjv() -> Iterator[str]:
    """The King James Bible (public domain; bible-kjv-text): every other chapter, verses as lines,
    so that its archaic register stays one source among several."""
    text = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], check=True, capture_output=True,
                          text=True).stdout
    chapters: dict[str, list[str]] = {}
    for line in text.splitlines():
        match = re.match(r"(\w+?\d*?)(\d+):\d+ (.*)", line)
        if match:
            chapters.setdefault(match[1] + match[2], []).append(match[3])
    for number, verses in enumerate(chapters.values()):
        if number % 2 == 0:
            yield from passages(verses)


def wordnet() -> Iterator[str]:
    """WordNet 3.0 (Princeton, WordNet licence): each synset as "words: definition; examples", every
    other passage (its 1.7 M words would otherwise be half the corpus)."""
    entries = []
    for part in ("noun", "verb", "adj", "adv"):
        for line in Path(f"/usr/share/wordnet/data.{part}").read_text(encoding="latin-1").splitlines():
            if line.startswith("  ") or " | " not in line:
                continue  # the licence header
            fields, gloss = line.split(" | ", 1)
            tokens = fields.split()
            count = int(tokens[3], 16)
            words = [tokens[4 + 2 * i].replace("_", " ") for i in range(count)]
            words = [re.sub(r"\(\w+\)$", "", w) for w in words]
            entries.append(f"{', '.join(words)}: {gloss.strip()}")
    # Short texts, so shorter passages.
    for number, passage in enumerate(passages(entries, words=PASSAGE_WORDS // 2)):
        if number % 2 == 0:
            yield passage


def _dictd(name: str) -> Iterator[tuple[str, str]]:
    """(headword, entry) of a dictd database (index offsets and lengths in dictd's base64 digits)."""
    digits = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}

    def number(code: str) -> int:
        value = 0
        for c in code:
            value = value * 64 + digits[c]
        return value

    data = gzip.open(f"/usr/share/dictd/{name}.dict.dz").read()
    for line in Path(f"/usr/share/dictd/{name}.index").read_text(encoding="utf-8").splitlines():
        head, offset, length = line.split("\t")[:3]
        if head.startswith("00-database") or head.startswith("00database"):
            continue
        yield head, data[number(offset):number(offset) + number(length)].decode("utf-8", "replace")


def _entry_text(entry: str) -> str:
    """A dictionary entry as prose: cross-reference braces dropped, lines rejoined into paragraphs."""
    entry = entry.replace("{", "").replace("}", "")
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", entry)]
    return "\n".join(p for p in paragraphs if p)


def jargon() -> Iterator[str]:
    """The Jargon File 4.4.7 (public domain): hacker usage and history, entry by entry."""
    yield from passages(_entry_text(entry) for _, entry in _dictd("jargon"))


def devil() -> Iterator[str]:
    """Ambrose Bierce's The Devil's Dictionary (public domain)."""
    yield from passages(_entry_text(entry) for _, entry in _dictd("devil"))


FORTUNE_FILES = ("art", "computers", "cookie", "definitions", "education", "food", "fortunes", "goedel",
                 "humorists", "kids", "law", "linuxcookie", "literature", "love", "magic", "medicine",
                 "men-women", "miscellaneous", "news", "people", "pets", "platitudes", "politics",
                 "riddles", "science", "songs-poems", "sports", "wisdom", "work")


def fortunes() -> Iterator[str]:
    """The BSD fortune database (fortunes, BSD licence): quotations, jokes, short dialogues."""
    cookies = []
    for name in FORTUNE_FILES:
        path = Path("/usr/share/games/fortunes") / name
        if path.is_file():
            text = path.read_text(encoding="utf-8", errors="replace")
            cookies += [" ".join(c.split()) for c in text.split("\n%\n") if len(c.split()) >= 4]
    yield from passages(cookies, words=PASSAGE_WORDS // 2)


ROLE = re.compile(r":[\w:.+-]+:`~?!?([^`<]*?)(?: <[^>]*>)?`")


def _rst_prose(text: str) -> list[str]:
    """The prose paragraphs of a reStructuredText page: directives, code blocks, tables and headings
    dropped, roles and inline markup reduced to their text."""
    paragraphs, keep = [], []
    for block in re.split(r"\n\s*\n", text):
        lines = block.splitlines()
        if not lines or lines[0].startswith((" ", "\t", "..", ">>>", "+", "=", "-", "*", "|")) and \
                not lines[0].startswith(("* ", "- ")):
            continue  # indented (code, directive bodies), directives, tables, headings' over-lines
        if len(lines) >= 2 and re.fullmatch(r"([=\-~^*#\"'`])\1+", lines[-1].strip()):
            continue  # a heading
        block = " ".join(line.strip() for line in lines)
        block = ROLE.sub(r"\1", block)
        block = re.sub(r"`([^`<]*?)(?: <[^>]*>)?`_*", r"\1", block)
        block = block.replace("``", "").replace("**", "").replace("::", ":")
        if len(block.split()) >= 8:
            keep.append(block)
    paragraphs += keep
    return paragraphs


def python_docs() -> Iterator[str]:
    """Python 3.11's documentation prose (PSF licence): tutorial, HOWTOs, FAQs, reference, library."""
    root = Path("/usr/share/doc/python3.11-doc/html/_sources")
    for page in sorted(root.rglob("*.rst.txt")):
        if "whatsnew" in page.parts or "c-api" in page.parts:
            continue  # change lists and C signatures, not prose
        yield from passages(_rst_prose(page.read_text(encoding="utf-8")))


SOURCES = {"austen": austen, "kjv": kjv, "wordnet": wordnet, "jargon": jargon, "devil": devil,
           "fortunes": fortunes, "python-docs": python_docs}


def main() -> None:
    records = [{"source": name, "text": text} for name, make in SOURCES.items() for text in make()]
    random.Random(SEED).shuffle(records)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with lzma.open(OUT, "wt", encoding="utf-8", preset=9 | lzma.PRESET_EXTREME) as out:
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    words: dict[str, int] = {}
    for record in records:
        words[record["source"]] = words.get(record["source"], 0) + len(record["text"].split())
    for name, count in words.items():
        print(f"{name:12s} {sum(r['source'] == name for r in records):7d} passages {count:9d} words")
    size = OUT.stat().st_size / 1e6
    print(f"{len(records)} passages, {sum(words.values())} words -> {OUT} ({size:.1f} MB)")


if __name__ == "__main__":
    main()
