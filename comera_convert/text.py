"""Text sources, the held-out split, and tokenized samples and blocks: what calibration, training
and evaluation read (files, directories, JSONL, Hugging Face datasets, or a built-in corpus).

Two corpora ship with the package and need no network:

``english``        natural English from seven public-domain or permissively licensed sources (novels,
                   the King James Bible, WordNet's definitions, the Jargon File, The Devil's
                   Dictionary, the fortune database's quotations, Python's documentation prose):
                   about 3 M words in passages of ~180 words (``corpora/README.md``). The default
                   for natural-language models.
``python-stdlib``  the source of the running Python's standard library (real code and docstrings, as
                   in CoMERA's code pre-training experiment).

and one training mix of them, ``english+python-stdlib``: english's training passages, each followed
by a piece of about 180 words of the standard library's training files until the pieces run out (a
broader text to distill on than prose alone; docs/findings.md). Built from the
two corpora's training documents only, so their held-out splits stay unread; the mix's own every-20th
document is its held-out split, as for any source.

Documents are split into train and held-out sets by a fixed rule (every 20th document is held out),
tokenized with the checkpoint's tokenizer and packed into blocks of ``seq_len`` tokens.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import lzma
import random
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from contextlib import contextmanager
from typing import Iterator

import torch

from .errors import ConfigError, SourceError
from .token_cache import cache_path, read_ids, text_digest, write_ids

ENGLISH = "english"
PYTHON_STDLIB = "python-stdlib"
BUILTIN = PYTHON_STDLIB  # the code corpus (what code models calibrate and train on by default)
ENGLISH_AND_CODE = "english+python-stdlib"
CORPORA = (ENGLISH, PYTHON_STDLIB)  # the built-in corpora, by name (and comera eval's default domains)
BUILTIN_SOURCES = (*CORPORA, ENGLISH_AND_CODE)  # every source --data and --calibration take by name
ENGLISH_FILE = Path(__file__).resolve().parent / "corpora" / "english.jsonl.xz"
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".c", ".h", ".js", ".ts", ".java", ".go", ".rs", ".json",
                 ".html", ".css", ".sh", ".yaml", ".yml", ".toml", ".tex"}
# A tokenizer that turns more than this share of a text into its unknown token cannot read it.
MAX_UNKNOWN_SHARE = 0.5
UNKNOWN_CHECK_TOKENS = 20_000  # checked after this much text, so that a hopeless source fails fast
# A --data file is binary when its first 8 KiB hold a NUL byte (as git and grep decide), or when
# more than a tenth of it does not decode as UTF-8.
BINARY_PROBE_BYTES = 8192
MAX_UNDECODABLE_SHARE = 0.1
HELD_OUT_EVERY = 20  # document i is held out when i % 20 == 19: 5 %


def is_held_out(index: int) -> bool:
    """Whether document ``index`` of a source belongs to its held-out split (training never reads it)."""
    return index % HELD_OUT_EVERY == HELD_OUT_EVERY - 1


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)


@contextmanager
def read_for(option: str):
    """Read text sources on behalf of ``option``: their failures name it (``--calibration PATH``
    where that is what the user typed, instead of the ``--data`` that training and eval take)."""
    try:
        yield
    except SourceError as err:
        if err.option == option:
            raise
        raise err.named(option) from None


def check_source(source: str) -> None:
    """Refuse, before anything slow, a source that names a file or folder that is not there, or a
    built-in corpus misspelled (a dataset name is only known to be wrong when it fails to load)."""
    if source in BUILTIN_SOURCES or Path(source).expanduser().exists():
        return
    if _reads_as_a_path(source):
        raise SourceError(f"{source}: no such file or directory")
    close = difflib.get_close_matches(source, BUILTIN_SOURCES, n=1, cutoff=0.7)
    if close:  # a typo, refused before a dataset hub is queried for it
        raise SourceError(f"{source!r} is not a built-in corpus (they are {', '.join(BUILTIN_SOURCES)}); "
                          f"did you mean {close[0]!r}?")


def _reads_as_a_path(source: str) -> bool:
    """Whether a source that is not there names a file or folder rather than a dataset: a text
    file's suffix, a start at the root, here or home, or deeper than a hub id's owner/name."""
    return (Path(source).suffix in (".txt", ".jsonl", ".json") or source.startswith(("/", ".", "~"))
            or source.count("/") > 1)


def english_documents() -> Iterator[str]:
    """The passages of the built-in ``english`` corpus, in its fixed (interleaved) order."""
    with lzma.open(ENGLISH_FILE, "rt", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


PIECE_WORDS = 180  # a code piece of the mix: about an english passage's length (~180 words)
MIN_PIECE_WORDS = 30  # a file's shorter tail is dropped
PIECE_SEED = 0  # the pieces' fixed shuffle: files would otherwise follow each other in path order


def code_pieces() -> list[str]:
    """The ``python-stdlib`` corpus's training documents cut at blank lines into pieces of
    ``PIECE_WORDS`` words or more, in a fixed shuffled order. Held out as that corpus holds out
    (by the index among its documents, the empty files left out), so that the held-out code
    ``comera eval`` measures stays unread."""
    pieces = []
    for text in training_documents(PYTHON_STDLIB):
        current, words = [], 0
        for paragraph in text.split("\n\n"):
            current.append(paragraph)
            words += len(paragraph.split())
            if words >= PIECE_WORDS:
                pieces.append("\n\n".join(current))
                current, words = [], 0
        if current and words >= MIN_PIECE_WORDS:
            pieces.append("\n\n".join(current))
    random.Random(PIECE_SEED).shuffle(pieces)
    return pieces


def mixed_documents() -> Iterator[str]:
    """``english+python-stdlib``: the english training passages in order, the first ones each
    followed by a code piece."""
    pieces = code_pieces()
    for index, passage in enumerate(training_documents(ENGLISH)):
        yield passage
        if index < len(pieces):
            yield pieces[index]


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def _text_file(path: Path) -> str:
    """A file given as text: refused, naming it, when it is binary (NUL bytes) or mostly not UTF-8."""
    data = path.read_bytes()
    text = data.decode("utf-8", errors="replace")
    undecodable = text.count("\ufffd") / max(len(text), 1)
    has_nul = b"\0" in data[:BINARY_PROBE_BYTES]
    if has_nul or undecodable > MAX_UNDECODABLE_SHARE:
        why = "it holds NUL bytes" if has_nul else f"{undecodable:.0%} of it is not UTF-8"
        raise SourceError(f"{path} is not a text file ({why}): pass text, a folder of text files, "
                          f"a JSONL file with a \"text\" field, or a built-in corpus ({', '.join(BUILTIN_SOURCES)})")
    return text


def _jsonl(path: Path) -> Iterator[str]:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise ConfigError(f"{path}:{number} is not valid JSON (expected one object per line)") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ConfigError(f"{path}:{number}: expected an object with a \"text\" string field")
            yield record["text"]


def _dataset(name: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise SourceError(f"{name!r} is neither a file, a directory nor a built-in corpus "
                          f"({', '.join(BUILTIN_SOURCES)}); to use it as a Hugging Face dataset, "
                          "pip install datasets") from None
    try:
        if Path(name).is_dir():
            data = datasets.load_from_disk(name)
        else:
            data = datasets.load_dataset(name, split="train")
    except Exception as err:  # datasets raises many kinds; all mean "cannot have it"
        raise ConfigError(f"cannot load the dataset {name!r} ({type(err).__name__}): check the name, or pass a "
                          f"built-in corpus ({', '.join(BUILTIN_SOURCES)}), a text file, a directory or a "
                          "JSONL file") from None
    if hasattr(data, "keys") and "train" in data:
        data = data["train"]
    if "text" not in data.column_names:
        raise ConfigError(f"dataset {name!r} has no \"text\" column (columns: {', '.join(data.column_names)})")
    yield from data["text"]


def documents(source: str) -> Iterator[str]:
    """The documents of a data source, in a fixed order."""
    if source == ENGLISH:
        yield from english_documents()
        return
    if source == PYTHON_STDLIB:
        for path in stdlib_files():
            text = _read(path)
            if text:
                yield text
        return
    if source == ENGLISH_AND_CODE:
        yield from mixed_documents()
        return
    path = Path(source).expanduser()
    if path.is_dir() and (path / "dataset_info.json").is_file():  # datasets' save_to_disk folder
        yield from _dataset(str(path))
        return
    if path.is_file():
        yield from (_jsonl(path) if path.suffix == ".jsonl" else [_text_file(path)])
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise SourceError(f"{source}: the directory has no text files "
                              f"(looked for {', '.join(sorted(TEXT_SUFFIXES))})")
        for file in files:
            text = _read(file)
            if text:
                yield text
    else:
        check_source(source)
        yield from _dataset(source)


def training_documents(source: str) -> Iterator[str]:
    """The documents of a data source that training reads: all but its held-out split."""
    return (text for index, text in enumerate(documents(source)) if not is_held_out(index))


def held_out_documents(source: str) -> Iterator[str]:
    """The documents of a data source's held-out split: those training never reads."""
    return (text for index, text in enumerate(documents(source)) if is_held_out(index))


@dataclass(frozen=True)
class Framing:
    """How a tokenizer's ids become blocks of ``seq_len``: encoders get [CLS] ... [SEP] around each
    block; documents are joined with the separator (or end-of-text) token."""

    body: int  # ids of text per block
    joiner: int | None
    cls_id: int | None
    sep_id: int | None

    @classmethod
    def of(cls, tokenizer, seq_len: int) -> "Framing":
        cls_id, sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id
        wrap = cls_id is not None and sep_id is not None
        body = seq_len - 2 if wrap else seq_len
        if body < 1:
            raise ConfigError(f"--seq-len {seq_len} is too short (expected at least 3)")
        joiner = sep_id if sep_id is not None else tokenizer.eos_token_id
        return cls(body, joiner, cls_id if wrap else None, sep_id if wrap else None)

    def ids(self, chunk: list[int]) -> list[int]:
        """A block's ids: ``chunk`` framed as the tokenizer frames a text."""
        return [self.cls_id] + chunk + [self.sep_id] if self.cls_id is not None else chunk

    def block(self, chunk: list[int]) -> torch.Tensor:
        return torch.tensor(self.ids(chunk))

    @property
    def wrapped(self) -> bool:
        return self.cls_id is not None


@dataclass
class Sample:
    """Blocks that start at document starts (``blocks[i]``: document i's consecutive blocks, as id
    lists; a short document runs on into the next ones) and how often each token id occurs in the
    text read. The blocks stay lists until ``spread`` picks some: a calibration reads millions of
    tokens for their counts and keeps a few hundred blocks, and a tensor per block read cost seconds."""

    blocks: list[list[list[int]]]
    counts: torch.Tensor
    tokens: int

    def spread(self, count: int) -> list[torch.Tensor]:
        """``count`` blocks evenly spread over the documents: every document's first block, then
        (when that is too few) second blocks, and so on, picked at even intervals."""
        pool: list[list[int]] = []
        depth = 0
        while len(pool) < count and any(len(b) > depth for b in self.blocks):
            pool += [b[depth] for b in self.blocks if len(b) > depth]
            depth += 1
        if len(pool) > count:
            picks = torch.linspace(0, len(pool) - 1, count).round().long().tolist()
            pool = [pool[i] for i in picks]
        return [torch.tensor(ids) for ids in pool]


def sample(source: str, tokenizer, seq_len: int, vocab_size: int, max_tokens: int) -> Sample:
    """Read the training split of ``source`` (at most ``max_tokens`` ids) into blocks that start at
    document starts, counting every token read (for calibration: many documents, not one long one)."""
    framing = Framing.of(tokenizer, seq_len)
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    per_document, stream, read = [], [], 0
    unknown = tokenizer.unk_token_id
    uncounted: list[int] = []
    for ids in training_token_ids(source, tokenizer):
        ids = ids[: max_tokens - read]
        read += len(ids)
        uncounted += ids
        if len(uncounted) >= COUNT_EVERY:  # the rest is counted after the loop
            _count(counts, uncounted)
        if unknown is not None and read >= UNKNOWN_CHECK_TOKENS and unknown < vocab_size:
            _count(counts, uncounted)
            _check_encodable(source, float(counts[unknown]) / read)
            unknown = None  # checked once
        stream.extend(ids + ([framing.joiner] if framing.joiner is not None else []))
        if len(stream) >= framing.body:
            usable = len(stream) - len(stream) % framing.body
            per_document.append([framing.ids(stream[i:i + framing.body]) for i in range(0, usable, framing.body)])
            stream = []  # the next block starts at the next document
        if read >= max_tokens:
            break
    _count(counts, uncounted)
    if not read:
        raise SourceError(f"{source}: no text found (the source is empty)")
    if unknown is not None and unknown < vocab_size:
        _check_encodable(source, float(counts[unknown]) / read)
    return Sample(per_document, counts, read)


# Token counts are added up this many ids at a time. Counting each document on its own allocated
# and freed two vocabulary-sized tensors per document, and glibc kept the freed memory: reading the
# english corpus's 4 M tokens grew the process by 2-5 GB that it never used again.
COUNT_EVERY = 2 ** 20


def _count(counts: torch.Tensor, ids: list[int]) -> None:
    """Add ``ids``' occurrences to ``counts`` (ids past its end are not counted) and empty ``ids``."""
    if ids:
        found = torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=len(counts))
        counts += found[: len(counts)].double()
        ids.clear()


def _check_encodable(source: str, unknown_share: float) -> None:
    if unknown_share > MAX_UNKNOWN_SHARE:
        raise SourceError(f"{source}: the model's tokenizer encodes {unknown_share:.0%} of this text "
                          f"as its unknown token (expected at most {MAX_UNKNOWN_SHARE:.0%}): give text in a "
                          "language and script the tokenizer covers")


# The built-in corpora are fixed text, so their training documents' token ids are kept for the two
# tokenizers a process saw last (int32, tens of MB): a process that calibrates more than once (the
# API converting several models, the test suite) tokenizes each corpus once, not every time; and on
# disk (token_cache.py), so that a later process reads them instead of tokenizing again.
_KEPT_IDS: dict[tuple[str, str], list[torch.Tensor]] = {}
KEPT_TOKENIZERS = 2


def training_token_ids(source: str, tokenizer) -> Iterator[list[int]]:
    """The token ids of ``source``'s training documents (the held-out ones skipped), in order."""
    training = training_documents(source)
    key = _kept_key(source, tokenizer)
    if key is None:
        yield from _token_ids(training, tokenizer)
        return
    if key not in _KEPT_IDS:
        encoded = _ids_kept_on_disk(source, key[1], tokenizer)
        while len(_KEPT_IDS) >= KEPT_TOKENIZERS:
            _KEPT_IDS.pop(next(iter(_KEPT_IDS)))  # the oldest
        _KEPT_IDS[key] = encoded
    for ids in _KEPT_IDS[key]:
        yield ids.tolist()


def _ids_kept_on_disk(source: str, tokenizer_digest: str, tokenizer) -> list[torch.Tensor]:
    """The training documents' ids from the disk cache (``token_cache``), tokenized and kept there
    when absent. The documents are read once: their digest names the file, and on a miss the same
    texts are tokenized."""
    texts = list(training_documents(source))
    path = cache_path(source, text_digest(texts), tokenizer_digest)
    encoded = read_ids(path)
    if encoded is None:
        encoded = [torch.tensor(ids, dtype=torch.int32) for ids in _token_ids(iter(texts), tokenizer)]
        write_ids(path, encoded)
    return encoded


def _kept_key(source: str, tokenizer) -> tuple[str, str] | None:
    """(corpus, digest of the tokenizer's definition) for a built-in corpus read by a fast
    tokenizer; None for anything else (files and datasets can change between reads). The digest
    leaves out the truncation and padding settings: every call of the tokenizer rewrites them (a
    loaded tokenizer's first call changed its digest, so the first corpus read was tokenized twice),
    and ``_token_ids`` encodes with neither."""
    if source not in BUILTIN_SOURCES or not getattr(tokenizer, "is_fast", False):
        return None
    definition = json.loads(tokenizer.backend_tokenizer.to_str())
    for call_setting in ("truncation", "padding"):
        definition.pop(call_setting, None)
    return source, hashlib.sha256(json.dumps(definition, sort_keys=True).encode()).hexdigest()


def _token_ids(texts: Iterator[str], tokenizer, chunk: int = 64) -> Iterator[list[int]]:
    """Each text's token ids, encoded a chunk of texts at a time (a fast tokenizer spreads a chunk
    over the cores)."""
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == chunk:
            yield from tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]
            batch = []
    if batch:
        yield from tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]


@dataclass
class Blocks:
    train: list[torch.Tensor]
    held_out: list[torch.Tensor]
    # The first block of every training document read that fills one: a text from its start, as
    # a sentence encoder embeds it (the packed blocks start anywhere).
    starts: list[torch.Tensor] = field(default_factory=list)
    wrapped: bool = True  # each block is [CLS] text [SEP] (an encoder's tokenizer)


def text_length(block: torch.Tensor, wrapped: bool) -> int:
    """The ids of text in a block, without its [CLS] and [SEP]."""
    return len(block) - 2 if wrapped else len(block)


def shortened(block: torch.Tensor, tokens: int, wrapped: bool) -> torch.Tensor:
    """A block cut to its first ``tokens`` ids of text, framed as the block was."""
    if tokens >= text_length(block, wrapped):
        return block
    return torch.cat([block[:1 + tokens], block[-1:]]) if wrapped else block[:tokens]


def pack(source: str, tokenizer, seq_len: int, max_train_blocks: int, max_held_out_blocks: int,
         start_len: int | None = None) -> Blocks:
    """Tokenize documents and pack them into blocks of ``seq_len`` token ids.

    Documents are joined with the separator (or end-of-text) token; encoder tokenizers get
    [CLS] ... [SEP] around each block. Stops reading once both sets are full. With
    ``max_held_out_blocks=0`` only training blocks are made (held-out documents still unread).
    Also keeps the start of every training document read that fills a block (``Blocks.starts``),
    up to ``start_len`` ids (None: ``seq_len``), as long as the document runs.
    """
    framing = Framing.of(tokenizer, seq_len)
    joiner, body = framing.joiner, framing.body
    start_body = body if start_len is None else Framing.of(tokenizer, start_len).body
    streams = {"train": [], "held_out": []}
    blocks = {"train": [], "held_out": []}
    limits = {"train": max_train_blocks, "held_out": max_held_out_blocks}
    starts = []
    empty = True
    for index, text in enumerate(documents(source)):
        empty = False
        split = "held_out" if is_held_out(index) else "train"
        if len(blocks[split]) >= limits[split]:
            if all(len(blocks[s]) >= limits[s] for s in blocks):
                break
            continue
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        if split == "train" and len(ids) >= body:
            starts.append((len(blocks["train"]), framing.block(ids[:start_body])))  # (where its text is packed, block)
        stream = streams[split]
        stream.extend(ids + ([joiner] if joiner is not None else []))
        while len(stream) >= body and len(blocks[split]) < limits[split]:
            chunk, streams[split] = stream[:body], stream[body:]
            stream = streams[split]
            blocks[split].append(framing.block(chunk))
    if empty:
        raise SourceError(f"{source}: no text found (the source is empty)")
    if not blocks["train"]:
        raise SourceError(f"{source}: too little text for one training block of {seq_len} tokens")
    train, held_out = blocks["train"], blocks["held_out"]
    if not held_out and max_held_out_blocks and len(train) > 1:
        # Fewer than 20 documents: hold out the last blocks instead (5 %, at least one).
        cut = len(train) - max(1, len(train) // HELD_OUT_EVERY)
        train, held_out = train[:cut], train[cut:]
        starts = [(at, block) for at, block in starts if at < cut]  # none from the held-out text
    return Blocks(train=train, held_out=held_out, starts=[block for _, block in starts],
                  wrapped=framing.wrapped)
