"""The package's layers only look down (ARCHITECTURE.md): every import of comera_convert's own modules,
at the top of a file or inside a function, goes to its own layer or a lower one; no two parts import
each other; and nothing below hf/ imports transformers."""

import ast
from collections import defaultdict
from pathlib import Path

import pytest

import comera_convert

ROOT = Path(comera_convert.__file__).parent
# Lowest first. A part may import its own layer and the layers below it.
LAYERS = [
    {"errors", "progress", "option_files", "choices", "machine", "token_cache"},
    {"tt", "codebook", "integer", "text", "request"},
    {"layers"},
    {"conversion"},
    {"hf", "models"},
    {"pipeline"},
    {"training", "retrieval", "peers"},
    {"evaluation"},
    {"api", "checkpoint_info", "recipes", "frontier"},
    {"bench", "cli", "__init__", "__main__"},
]
WITHOUT_TRANSFORMERS = {"errors", "progress", "option_files", "choices", "machine", "token_cache", "tt", "codebook",
                        "integer", "text", "layers", "conversion", "request"}


def part_of(module: str) -> str:
    """The top-level part of a dotted module name: comera_convert.hf.saving -> hf."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = ["comera_convert", *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path = ROOT) -> set[str]:
    """Every module this file imports (absolute names), top-level or inside functions."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)  # `from . import api`
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def is_module(dotted: str, root: Path = ROOT) -> bool:
    path = root.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def part_graph(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(part -> parts it imports, part -> its files that import transformers)."""
    graph, transformers_users = defaultdict(set), defaultdict(set)
    for path in root.rglob("*.py"):
        source = part_of(module_name(path, root))
        for target in imports(path, root):
            if target.split(".")[0] == "transformers":
                transformers_users[source].add(str(path.relative_to(root)))
            elif target.startswith("comera_convert") and is_module(target, root) and part_of(target) != source:
                graph[source].add(part_of(target))
    return graph, transformers_users


def layer_of(part: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if part in layer)


def test_every_part_has_a_layer():
    parts = {part_of(module_name(p)) for p in ROOT.rglob("*.py")}
    assert parts <= set().union(*LAYERS), f"parts without a layer: {parts - set().union(*LAYERS)}"


def test_imports_only_look_down():
    graph, _ = part_graph()
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a))
    assert not upward, f"upward imports: {upward}"


def test_no_import_cycle_between_parts():
    graph, _ = part_graph()
    cycles = sorted(f"{a} <-> {b}" for a, targets in graph.items() for b in targets if a in graph.get(b, ()))
    assert not cycles, f"parts importing each other: {cycles}"


def test_nothing_below_hf_imports_transformers():
    _, users = part_graph()
    offenders = {part: files for part, files in users.items() if part in WITHOUT_TRANSFORMERS}
    assert not offenders, f"transformers imported below hf/: {offenders}"


def module_graph(part: str, root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of the same part it imports (top-level or inside functions)."""
    graph = {}
    for path in (root / part).rglob("*.py"):
        name = module_name(path, root)
        graph[name] = {t for t in imports(path, root)
                       if t != name and t.startswith(f"comera_convert.{part}") and is_module(t, root)}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules that import each other, directly or round a circle (strongly connected components)."""
    order, low, stack, cycles = {}, {}, [], []

    def visit(module):
        order[module] = low[module] = len(order)
        stack.append(module)
        for target in graph.get(module, ()):
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            component = []
            while True:
                component.append(stack.pop())
                if component[-1] == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in list(graph):
        if module not in order:
            visit(module)
    return cycles


@pytest.mark.parametrize("part", sorted(set().union(*LAYERS)))
def test_no_import_circle_inside_a_room(part):
    """Every room imports in one direction: no two of its modules import each other, directly or round a
    circle, at the top of a file or inside a function."""
    assert not import_cycles(module_graph(part)), import_cycles(module_graph(part))


def test_the_pipeline_runs_its_stages_from_one_place():
    """Only pipeline/run.py starts the stages' runner; nothing in the pipeline imports it back."""
    graph = module_graph("pipeline")
    callers = sorted(m for m, targets in graph.items() if "comera_convert.pipeline.run" in targets)
    assert callers == [], callers


def test_the_cycle_checker_finds_a_circle():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_the_checker_sees_an_upward_import(tmp_path):
    """The checks can fail: a conversion module importing hf is found."""
    fake = tmp_path / "comera_convert"
    (fake / "conversion").mkdir(parents=True)
    (fake / "hf").mkdir()
    for folder in (fake, fake / "conversion", fake / "hf"):
        (folder / "__init__.py").write_text("")
    (fake / "hf" / "saving.py").write_text("")
    (fake / "conversion" / "bad.py").write_text("from ..hf.saving import x\nimport transformers\n")
    graph, users = part_graph(fake)
    assert graph["conversion"] == {"hf"} and layer_of("hf") > layer_of("conversion")
    assert users["conversion"] == {"conversion/bad.py"}


# Modules that import the package's own modules inside functions, and why: the CLI so that every --help stays
# torch-free and quick; the others each say why on the import's line.
LAZY_IMPORTERS = {"cli"}
LAZY_WITH_A_REASON = {"request.py", "hf/registration.py", "pipeline/factorize.py"}


def test_own_modules_are_imported_at_the_top_except_where_a_reason_is_given():
    lazy = []
    for path in ROOT.rglob("*.py"):
        relative = str(path.relative_to(ROOT))
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for sub in ast.walk(node):
                name = (sub.module or "") if isinstance(sub, ast.ImportFrom) else \
                    sub.names[0].name if isinstance(sub, ast.Import) else None
                own = name is not None and (getattr(sub, "level", 0) or name.startswith("comera_convert"))
                if not own or relative.split("/")[0] in LAZY_IMPORTERS:
                    continue
                reasoned = relative in LAZY_WITH_A_REASON and (
                    "#" in lines[sub.lineno - 1] or lines[sub.lineno - 2].strip().startswith("#"))
                if not reasoned:
                    lazy.append(f"{relative}:{sub.lineno}")
    assert lazy == [], f"imported inside a function without a reason: {lazy}"
