"""The project's prose stays true and short: comments say why in a few lines and link the figures
(BENCHMARKS.md) instead of copying them, every link into BENCHMARKS.md names a section that exists,
and the README stays a front page."""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

import comera_convert

ROOT = Path(comera_convert.__file__).parent
REPO = ROOT.parent
# A measured figure: a decimal with two or more places (0.863), a speed-up or size ratio (2.5x), a time (8 s, 10 ms).
FIGURE = re.compile(r"(?<![\w.])\d+\.\d{2,}\b|(?<![\w.])\d+(?:\.\d+)?x\b|(?<![\w.])\d+(?:\.\d+)? ?(?:s|ms|min)\b")
BENCHMARK_LINK = re.compile(r"BENCHMARKS\.md#([\w-]+)")
MAX_README_LINES = 200


def comment_blocks(source: str):
    """(first line number, lines) of each run of consecutive comment lines."""
    block, start = [], 0
    for number, line in enumerate([*source.splitlines(), ""], start=1):
        stripped = line.strip()
        if stripped.startswith("#") and not stripped.startswith("#!"):
            start = start if block else number
            block.append(stripped)
        elif block:
            yield start, block
            block = []


def long_comments_with_figures(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for start, block in comment_blocks(path.read_text()):
            if len(block) > 3 and any(FIGURE.search(BENCHMARK_LINK.sub("", line)) for line in block):
                found.append(f"{path.relative_to(root)}:{start}")
    return found


# A measurement quoted as a result: a share or cosine to three places (0.874), a comparison (0.84 against
# 0.83), a speed-up (1.12x faster). Shapes and versions (14x smaller, 5.2x) are not measurements.
MEASURED = re.compile(r"(?<![\w.])0\.\d{3}(?!\d)|\d(?:\.\d+)? against \d|\d+(?:\.\d+)?x (?:faster|slower)")


def prose(source: str):
    """(line, text) of every comment and docstring of a module's source."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield node.body[0].lineno, doc


def measured_figures_in_prose(root: Path) -> list[str]:
    return [f"{path.relative_to(root)}:{line}: {found.group(0)}" for path in sorted(root.rglob("*.py"))
            for line, text in prose(path.read_text()) for found in MEASURED.finditer(text)]


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub (and the docs site, whose slugs follow it) gives a file's headings."""
    anchors, seen = set(), {}
    for line in markdown.splitlines():
        heading = re.match(r"#+\s+(.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_no_comment_over_three_lines_holds_measured_figures():
    assert not long_comments_with_figures(ROOT), long_comments_with_figures(ROOT)


def test_the_comment_check_finds_figures(tmp_path):
    (tmp_path / "m.py").write_text("# why\n# measured: 0.863 of dense\n# and more\n# and more\nX = 1\n"
                                   "# short, 0.863\nY = 2\n# long\n# without\n# any figure\n# at all\nZ = 3\n")
    assert long_comments_with_figures(tmp_path) == ["m.py:1"]


def test_no_comment_or_docstring_quotes_a_measurement():
    """Figures go stale silently in code: they live in the records (docs/findings.md, BENCHMARKS.md)."""
    assert not measured_figures_in_prose(ROOT), measured_figures_in_prose(ROOT)


def test_the_measurement_check_finds_one(tmp_path):
    (tmp_path / "m.py").write_text('"""Fast: 1.12x faster."""\n# keeps 0.874\nX = 0.874  # a value, not prose\n'
                                   'def f():\n    """0.84 against 0.83."""\n# 14x smaller; transformers 5.2x\n')
    assert measured_figures_in_prose(tmp_path) == ["m.py:2: 0.874", "m.py:1: 1.12x faster", "m.py:5: 0.84 against 0"]


def test_every_link_into_benchmarks_names_a_section():
    anchors = github_anchors((REPO / "BENCHMARKS.md").read_text())
    files = [*ROOT.rglob("*.py"), REPO / "README.md", *(REPO / "docs").rglob("*.md"),
             *(ROOT / "recipes").glob("*.yaml")]
    broken = sorted(f"{path.relative_to(REPO)}: {anchor}" for path in files if path.is_file()
                    for anchor in BENCHMARK_LINK.findall(path.read_text()) if anchor not in anchors)
    assert not broken, broken


def test_the_readme_is_a_front_page():
    assert len((REPO / "README.md").read_text().splitlines()) <= MAX_README_LINES


def test_the_docs_build_names_the_extra_it_misses(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_docs", REPO / "tools" / "build_docs.py")
    build_docs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_docs)

    def nothing_installed(name):
        raise ModuleNotFoundError(name)

    assert build_docs.missing_packages(nothing_installed) == list(build_docs.DOCS_MODULES.values())
    original = build_docs.missing_packages
    build_docs.missing_packages = lambda: ["mkdocs-material"]
    try:
        assert build_docs.main([]) == 2
    finally:
        build_docs.missing_packages = original
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "pip install -e '.[docs]'" in error and "missing: mkdocs-material" in error


def test_the_docs_hook_names_public_objects_without_a_docstring(tmp_path, monkeypatch):
    """What `mkdocs build --strict` fails on: an object the API reference documents, or a public member of
    it, without a docstring (tools/docs_docstring_hook.py warns; --strict turns the warning into a failure)."""
    import importlib.util

    pytest.importorskip("griffe")
    package = tmp_path / "sample_pkg"
    package.mkdir()
    (package / "__init__.py").write_text('"""A package."""\n')
    (package / "api.py").write_text('"""Verbs."""\n\n\ndef documented():\n    """Does it."""\n\n\n'
                                    'def bare():\n    pass\n\n\ndef _private():\n    pass\n\n\n'
                                    'class Thing:\n    """A thing."""\n\n    def method(self):\n        pass\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = importlib.util.spec_from_file_location("docstrings_hook", REPO / "tools" / "docs_docstring_hook.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    assert hook.undocumented("sample_pkg.api.documented") == []
    assert hook.undocumented("sample_pkg.api") == ["sample_pkg.api.bare"]
    assert hook.undocumented("sample_pkg.api.Thing") == ["sample_pkg.api.Thing.method"]


# Words of how the project is worked on, not of what it does: a reader cannot tell which figures
# describe the code in front of them. Dates and versions say when instead.
PROCESS_WORDS = re.compile(r"\bsessions? \d+|(?<![\w&/#])#\d+\b|\btoday's|\btoday\b|\buntil now\b|\basked\b"
                           r"|\bmet\b|\bthe target\b(?! ratio)", re.IGNORECASE)
PROSE_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".toml", ".cfg", ".sh", ".json")


def project_files() -> list[Path]:
    """What users and contributors read: the front page, docs, benchmarks and their records, the
    changelog, examples, tools, the tests (but this file, whose samples hold such words) and the package
    itself."""
    files = [REPO / name for name in ("README.md", "BENCHMARKS.md", "CHANGELOG.md", "CONTRIBUTING.md",
                                      "ARCHITECTURE.md", "pyproject.toml", "setup.cfg", "mkdocs.yml")]
    for folder in ("docs", "examples", "benchmarks", "tools", "comera_convert", ".ci", "tests"):
        files += [path for path in (REPO / folder).rglob("*") if path.suffix in PROSE_SUFFIXES or
                  (folder == ".ci" and path.is_file())]
    return [path for path in files if path.is_file() and path != Path(__file__).resolve()]


def process_words(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            for match in PROCESS_WORDS.finditer(line):
                found.append(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{number}: "
                             f"{match.group(0)!r}")
    return found


def test_no_process_words_in_the_project():
    assert not process_words(project_files()), process_words(project_files())


def test_the_process_word_check_finds_them(tmp_path):
    (tmp_path / "a.md").write_text("Measured in session 12 (#64's target): met.\nThe target ratio holds.\n"
                                   "`comera train --target-ratio 4` reaches the target ratio; today's defaults.\n"
                                   "[link](#anchor-64) and &#8212; stay.\n")
    found = process_words([tmp_path / "a.md"])
    assert [entry.split(": ", 1)[1] for entry in found] == ["'session 12'", "'#64'", "'met'", "\"today's\""]


TORCH_RANGE = re.compile(r"torch\s*((?:[<>!~]=?|==)\s*[\d.]+(?:\s*,\s*(?:[<>!~]=?|==)\s*[\d.]+)*)")


def declared_torch() -> str:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later

    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(dep.removeprefix("torch").replace(" ", "") for dep in dependencies if dep.startswith("torch"))


def test_the_torch_range_is_stated_as_pyproject_declares_it():
    """Every range of torch the documentation states is the declared one; a pinned torch (the test
    command's CPU build) lies inside it."""
    from packaging.specifiers import SpecifierSet

    declared = declared_torch()
    documents = [REPO / "README.md", REPO / "CONTRIBUTING.md", *(REPO / "docs").glob("*.md"), REPO / ".ci" / "run",
                 *(REPO / "tools").glob("*.sh")]
    stated = [(path.name, match.group(1).strip().rstrip(",").replace(" ", "")) for path in documents
              for match in TORCH_RANGE.finditer(path.read_text())]
    assert stated, "the documentation states no torch requirement"
    for name, spec in stated:
        if spec.startswith("=="):
            assert spec[2:] in SpecifierSet(declared), f"{name} pins torch {spec}, outside {declared}"
        else:
            assert spec == declared, f"{name} states torch{spec}; pyproject.toml declares torch{declared}"


def test_the_changelog_has_a_short_release_section():
    text = (REPO / "CHANGELOG.md").read_text()
    from comera_convert import __version__

    sections = re.split(r"^## ", text, flags=re.MULTILINE)
    unreleased = next(s for s in sections if s.startswith("[Unreleased]"))
    release = next(s for s in sections if s.startswith(f"[{__version__}]"))
    assert re.match(rf"\[{re.escape(__version__)}\] - \d{{4}}-\d{{2}}-\d{{2}}", release)
    assert len(release.splitlines()) <= 80
    assert text.index("## [Unreleased]") < text.index(f"## [{__version__}]")
    assert not [line for line in unreleased.splitlines() if line.startswith("- ") and len(line) > 120]


def test_the_line_width_is_the_linters():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later

    ruff = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["ruff"]
    contributing = (REPO / "CONTRIBUTING.md").read_text()
    assert f"{ruff['line-length']} columns" in contributing
    assert "flake8" not in (REPO / "setup.cfg").read_text()
