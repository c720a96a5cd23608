"""The project's prose stays true and short: comments say why in a few lines and link the figures
(BENCHMARKS.md) instead of copying them, every link into BENCHMARKS.md names a section that exists,
and the README stays a front page."""

import re
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


def test_every_link_into_benchmarks_names_a_section():
    anchors = github_anchors((REPO / "BENCHMARKS.md").read_text())
    files = [*ROOT.rglob("*.py"), REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "recipes").glob("*")]
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
