"""Subcommands of `comera`: thin shells over the library (registered on import)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import click

from ..choices import EXPORT_FORMATS, FORM_REQUESTS, INT8_ARCHES
from ..errors import ConfigError
from ..models import TASK_CLASSES
from ..request import ConvertRequest
from .group import ARGV_KEY, main
from .dataclass_options import SectionedCommand, flags_from, patterns
from .console import console, echo_json, progress_display


def command_line() -> str:
    """The command as typed, for the report and model card (`comera convert minilm --ratio 4`)."""
    import shlex

    return shlex.join(["comera", *click.get_current_context().meta.get(ARGV_KEY, [])])


def _default_out(model: str, ratio, rank) -> str:
    stem = Path(model.rstrip("/")).name or "model"
    return f"{stem}-tt{ratio:g}" if rank is None else f"{stem}-rank{rank}"


@main.command(cls=SectionedCommand)
@click.argument("model")
@flags_from(ConvertRequest)
@click.option("--no-calibration", is_flag=True, default=False,
              help="Plain TT-SVD of the weights, no calibration text (keeps far less of the model).")
@click.option("--recipe", default=None, metavar="NAME|FILE",
              help="A conversion recipe: a packaged one by name (`comera recipes`) or a YAML file; options "
                   "given here override it.")
@click.option("--task", type=click.Choice(list(TASK_CLASSES)), default=None,
              help="Load the model with this head [default: its recorded architecture].")
@click.option("--out", type=click.Path(), default=None, help="Output directory [default: <model>-tt<ratio>].")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty output directory.")
@click.option("--max-shard-size", default=None, metavar="SIZE",
              help="Split the weights into files of at most SIZE (e.g. 2GB), with an index [default: 50GB].")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of tables.")
def convert(model, no_calibration, recipe, task, out, overwrite, max_shard_size, as_json, **given):
    """Convert MODEL (directory, hub id or alias such as minilm, bert-base) to a TT checkpoint."""
    from ..recipes import convert_options
    from ..api import convert_checkpoint

    options = convert_options(recipe, given)
    if no_calibration:
        if given["calibration"]:
            raise ConfigError("give --calibration DATA or --no-calibration, not both")
        options = dataclasses.replace(options, calibration=None)
    out = out or _default_out(model, options.ratio, options.rank)
    from ..conversion.calibration import DEFAULT_CALIBRATION

    with progress_display() as progress:
        result = convert_checkpoint(model, out, options, task=task, overwrite=overwrite, progress=progress,
                                    default_calibration=None if no_calibration else DEFAULT_CALIBRATION,
                                    command=command_line(), max_shard_size=max_shard_size)
    if as_json:
        echo_json({"out": str(result.out), "report": result.report.to_dict(), "disk_bytes": result.disk_bytes,
                   "timings": result.timings, "notes": result.notes})
        return
    _print_conversion(result, calibrated="calibration" in result.report.extra)


def _print_conversion(result, calibrated: bool) -> None:
    from .render import modules_table, totals_table

    out = console()
    out.print(modules_table(result.report, out.width))
    out.print(totals_table(result.report, result.disk_bytes))
    out.print(f"[green]wrote[/] {result.out}  ({_stage_seconds(result.timings)})", soft_wrap=True)
    for note in result.notes:
        out.print(f"[yellow]note:[/] {note}", soft_wrap=True)
    if not calibrated:  # plain TT-SVD of pretrained weights keeps little of the model's function
        out.print(f"[dim]tip: calibration (the default, english+python-stdlib, or --calibration with your own "
                  f"text) fits each layer to real activations; `comera eval {result.out}` measures the result[/]",
                  soft_wrap=True)


# The order a conversion's stages run in, the module loop ("convert") before the checkpoint is written; a stage
# the list does not know comes last.
STAGE_ORDER = ("allocate", "load", "calibrate", "reconstruct", "convert", "save")


def _stage_seconds(timings: dict[str, float]) -> str:
    """Each stage that ran with its seconds, in the order they run ("load 0.1 s, calibrate 86.9 s, ...")."""
    order = sorted(timings, key=lambda name: STAGE_ORDER.index(name) if name in STAGE_ORDER else len(STAGE_ORDER))
    return ", ".join(f"{name} {timings[name]:.1f} s" for name in order)


@main.command()
@click.argument("models", nargs=-1, required=True)
@click.option("--compare", is_flag=True, help="Show the models side by side.")
@click.option("--by-module", is_flag=True, help="One row per module instead of per block type.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def report(models, compare, by_module, as_json):
    """Show what was compressed in MODELS and by how much."""
    from ..checkpoint_info import inspect_checkpoint

    infos = [inspect_checkpoint(m) for m in models]
    if as_json:
        echo_json([i.to_dict() for i in infos] if len(infos) > 1 else infos[0].to_dict())
        return
    from .render import compare_table, modules_table, plan_table, totals_table

    out = console()
    if compare or len(infos) > 1:
        out.print(compare_table(infos, out.width))
        return
    info = infos[0]
    if info.report is None:
        out.print(f"{info.name}: {info.model_type}, {info.params:,} parameters, not compressed")
        return
    out.print(modules_table(info.report, out.width, by_block=not by_module))
    out.print(totals_table(info.report, info.disk_bytes))
    planned = plan_table(info.report, out.width)
    if planned is not None:
        out.print(planned)


@main.command(name="recipes")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def list_recipes(as_json):
    """List the recipes that ship with the package: `--recipe NAME` takes any of them."""
    from ..recipes import packaged_recipes, purpose
    from .render import fitted

    found = {name: purpose(path) for name, path in packaged_recipes().items()}
    if as_json:
        echo_json(found)
        return
    out = console()
    out.print(fitted("packaged recipes", [("name", "left"), ("what it is for", "left")],
                     [[name, text] for name, text in found.items()], out.width))


@main.command()
@click.argument("model")
@click.option("--out", type=click.Path(), required=True, help="Directory for the dense checkpoint.")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty output directory.")
@click.option("--max-shard-size", default=None, metavar="SIZE",
              help="Split the weights into files of at most SIZE (e.g. 2GB), with an index [default: 50GB].")
def decompress(model, out, overwrite, max_shard_size):
    """Write an ordinary dense checkpoint of a compressed MODEL."""
    from ..api import decompress as decompress_checkpoint

    start = time.perf_counter()
    with progress_display() as progress:
        path = decompress_checkpoint(model, out, overwrite=overwrite, progress=progress,
                                     max_shard_size=max_shard_size)
    console().print(f"[green]wrote[/] dense checkpoint {path} in {time.perf_counter() - start:.1f} s", soft_wrap=True)


@main.command(name="eval")
@click.argument("model")
@click.option("--reference", default=None, help="The dense model to compare with [default: the recorded source].")
@click.option("--data", multiple=True,
              help="Another domain of held-out text (file, directory, JSONL, dataset); repeatable. The "
                   "held-out splits of english and python-stdlib are always measured.")
@click.option("--pairs", "pair_files", multiple=True, type=click.Path(dir_okay=False),
              help='A JSONL file of {"query": ..., "document": ...} lines: retrieval of each query\'s '
                   'document among all of them, a domain of its own; repeatable.')
@click.option("--texts", type=int, default=64, show_default=True,
              help="How many texts (and query/document pairs) per domain.")
@click.option("--seq-len", type=int, default=128, show_default=True, help="Tokens per text (truncated).")
@click.option("--baselines", is_flag=True,
              help="Also measure the peers on the same texts, with every model's bytes: the dense model in "
                   "bfloat16, rounded to int8 and by HQQ to 4, 3 and 2 bits, and Model2Vec distilled from it in the "
                   "compressed model's bytes (pip install 'comera-convert[peers]' for HQQ and Model2Vec).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True), is_flag=False, flag_value="-",
              default=None, help="Write the metrics as JSON to this file; alone, print them instead of tables.")
@click.option("--dense", "dense_patterns", default=None, metavar="PATTERNS",
              help="Comma-separated module-name patterns (as --exclude of convert) whose compressed modules "
                   "are put back dense before scoring: which layers carry the loss (e.g. word_embeddings, or "
                   "encoder). Such a score is not recorded in the checkpoint's report.")
def evaluate(model, reference, data, pair_files, texts, seq_len, baselines, json_path, dense_patterns):
    """How close compressed MODEL is to its dense source on held-out text, domain by domain, and
    how much of its retrieval it keeps (recall@1 of each passage's rest by its first sentence)."""
    from ..evaluation import evaluate as run_eval
    from ..evaluation import record_in_report
    from ..hf.files import write_text_atomic
    from ..models import resolve
    from .render import eval_table, peers_table

    with progress_display() as progress:
        metrics = run_eval(model, reference, data=list(data), texts=texts, seq_len=seq_len, baselines=baselines,
                           progress=progress, pairs=list(pair_files), dense=patterns(dense_patterns))
    restored = metrics.get("restored_dense")
    if not restored:  # an ablation is not the checkpoint's score
        record_in_report(resolve(model), metrics)
    if json_path == "-":
        echo_json(metrics)
        return
    out = console()
    if restored:
        out.print(f"put back dense: {len(restored)} modules ({', '.join(restored[:3])}"
                  f"{', ...' if len(restored) > 3 else ''})", highlight=False, soft_wrap=True)
    out.print(eval_table(model, metrics, out.width))
    out.print(f"worst domain: [bold]{metrics['worst_domain']}[/]")
    for label, domains in metrics.get("baselines", {}).items():
        baseline = {"reference": metrics["reference"], "domains": domains, "worst_domain": None}
        out.print(eval_table(f"baseline: {label}", baseline, out.width))
    if "sizes" in metrics:
        out.print(peers_table(model, metrics, out.width))
    for note in metrics.get("notes", []):
        out.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    if json_path:
        write_text_atomic(Path(json_path), json.dumps(metrics, indent=2) + "\n")


@main.command()
@click.argument("models", nargs=-1, required=True)
@click.option("--pairs", "pair_files", type=click.Path(exists=True, dir_okay=False), multiple=True, metavar="FILE",
              help="A JSONL file of {\"query\": ..., \"document\": ...} lines, a domain of its own; repeatable.")
@click.option("--texts", type=int, default=200, show_default=True, help="Query/document pairs per domain.")
@click.option("--no-peers", is_flag=True, help="Only the given checkpoints: no rounding or Model2Vec peers.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, metavar="PNG",
              help="Write the share kept against the bytes as a plot.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True), is_flag=False, flag_value="-",
              default=None, help="Write the frontier as JSON to this file; alone, print it instead of a table.")
def frontier(models, pair_files, texts, no_peers, plot, json_path):
    """Compressed MODELS of one source and its peers by bytes: the share of dense retrieval each keeps."""
    from ..frontier import plot_frontier, size_frontier
    from ..hf.files import write_text_atomic
    from .render import frontier_table

    with progress_display() as progress:
        result = size_frontier(list(models), pairs=list(pair_files), texts=texts, peers=not no_peers,
                               progress=progress)
    if plot:
        plot_frontier(result, Path(plot))
    if json_path == "-":
        echo_json(result)
        return
    out = console()
    out.print(frontier_table(result, out.width))
    for note in result["notes"]:
        out.print(f"[yellow]note:[/] {note}", highlight=False, soft_wrap=True)
    if json_path:
        write_text_atomic(Path(json_path), json.dumps(result, indent=2) + "\n")


def _export_options(command):
    options = [
        click.argument("model"),
        click.option("--format", "fmt", type=click.Choice(EXPORT_FORMATS), default="onnx", show_default=True,
                     help="Runtime to serve in: graphs go in onnx/ (ONNX Runtime) or openvino/ (OpenVINO), "
                          "where sentence-transformers' backend of that name looks."),
        click.option("--out", type=click.Path(),
                     help="A copy of MODEL without its PyTorch weights to write into (config, tokenizer, sentence-"
                          "transformers modules, the graphs' folder); default: the graphs' folder inside MODEL."),
        click.option("--quantize", type=click.Choice(["int8"]),
                     help="Also write the int8 graph, quantized as sentence-transformers quantizes its exports: "
                          "onnx/model_qint8_ARCH.onnx (dynamic), or openvino/openvino_model_qint8_quantized.xml "
                          "(static, calibrated on the package's english corpus)."),
        click.option("--arch", type=click.Choice(INT8_ARCHES),
                     help="CPU the ONNX int8 graph is quantized for (its file name says which)  "
                          "[default: this machine's]"),
        click.option("--opset", type=int, default=18, show_default=True, help="ONNX operator set (18 or later)."),
        click.option("--dtype", type=click.Choice(["float32", "float16"]), default="float32", show_default=True,
                     help="Precision of the exported ONNX graph."),
        click.option("--forms", type=click.Choice(FORM_REQUESTS), default="auto", show_default=True,
                     help="Each low-rank pair as two products or multiplied out, and in the int8 graph each layer in "
                          "int8 or float: the fastest of each, timed on this machine (auto), or one form for every "
                          "pair with every layer in int8; written to serving_forms.json beside the graphs."),
        click.option("--overwrite", is_flag=True, help="Replace a non-empty --out folder, or MODEL's graphs folder."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


@main.command(name="export")
@_export_options
def export(model, fmt, out, quantize, arch, opset, dtype, forms, overwrite):
    """Export compressed MODEL for ONNX Runtime or OpenVINO, still compressed, checked against PyTorch; loads
    with SentenceTransformer(folder, backend="onnx" or "openvino") where comera_convert is not installed."""
    from ..hf.export import export_model

    start = time.perf_counter()
    with progress_display() as progress:
        result = export_model(model, out, opset=opset, dtype=dtype, quantize=quantize, arch=arch, overwrite=overwrite,
                            fmt=fmt, forms=forms, progress=progress)
    checked = (f"not checked: {result.checked_by} is not installed" if result.max_difference is None
               else f"{result.checked_by} agrees with PyTorch to {result.max_difference:.1e}")
    console().print(f"[green]wrote[/] {result.graphs[0]} (opset {result.opset}, output "
                    f"{result.output_name}; {checked}) in {time.perf_counter() - start:.1f} s", soft_wrap=True)
    if result.int8_difference is not None:
        console().print(f"[green]wrote[/] {result.graphs[1]} (int8; hidden states within "
                        f"{result.int8_difference:.1%} of PyTorch's)", soft_wrap=True)
    for note in result.notes:
        console().print(f"[yellow]note:[/] {note}", soft_wrap=True)


@main.command(name="export-onnx", hidden=True)
@_export_options
@click.pass_context
def export_onnx(ctx, **options):
    """`comera export` under its earlier name."""
    ctx.invoke(export, **options)
