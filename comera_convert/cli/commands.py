"""Subcommands of `comera`: thin shells over the library (registered on import)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from ..choices import ALLOCATIONS, EXPORT_FORMATS, FFN_METHODS, INT8_ARCHES, WORD_EMBEDDINGS
from ..errors import ConfigError
from ..models import TASK_CLASSES
from .group import ARGV_KEY, main
from .console import console, echo_json, progress_display


def command_line() -> str:
    """The command as typed, for the report and model card (`comera convert minilm --ratio 4`)."""
    import shlex

    return shlex.join(["comera", *click.get_current_context().meta.get(ARGV_KEY, [])])


def _patterns(value: str | None):
    return [p.strip() for p in value.split(",") if p.strip()] if value else None


def _rank_scales(file: str) -> dict:
    """The per-layer rank scales in ``file``: a JSON object of them, or a report recording learned ones."""
    try:
        data = json.loads(Path(file).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"--rank-scales {file}: expected a JSON file ({err})") from None
    if isinstance(data, dict) and isinstance(data.get("extra"), dict) and "modules" in data:  # a report
        if "rank_scales" not in data["extra"]:
            raise ConfigError(f"--rank-scales {file}: this report records no learned rank scales (the conversion "
                              f"used the {data['extra'].get('allocation', 'uniform')} allocation)")
        data = data["extra"]["rank_scales"]
    return data


def _default_out(model: str, ratio, rank) -> str:
    stem = Path(model.rstrip("/")).name or "model"
    return f"{stem}-tt{ratio:g}" if rank is None else f"{stem}-rank{rank}"


@main.command()
@click.argument("model")
@click.option("--ratio", type=float, default=None, help="Shrink the whole model this many times [default: 4].")
@click.option("--rank", type=int, default=None, help="A fixed max rank for every layer instead of --ratio.")
@click.option("--layout", default=None, help="Layout of linear layers: tt (CoMERA) or ttm [default: tt].")
@click.option("--embedding-layout", default=None,
              help="Layout of embeddings: tt or ttm (CoMERA) [default: tt].")
@click.option("--word-embedding", type=click.Choice(WORD_EMBEDDINGS), default=None,
              help="The input embedding as a tt, or as a codebook table (one byte per 4 columns of a row, "
                   "shared centres) whose savings go to the linears [default: codebook with --ratio, tt with --rank].")
@click.option("--codebook-width", type=int, default=None, metavar="N",
              help="Columns per slice of a codebook table: each row stores one byte per N columns; 8 halves "
                   "the codes' bytes (what --ratio 8 --dtype int4 needs for 32x) [default: 4].")
@click.option("--modes", "d", type=int, default=None,
              help="Tensor modes per side, 1 (plain low-rank, a truncated SVD) to 4 [default: 1 with --ratio "
                   "and a codebook table; with a tt table or ttm 3 below --ratio 3, 2 from 3, 1 from 4 (tt); "
                   "3 with --rank].")
@click.option("--targets", default=None, help="Comma-separated module-name patterns to convert.")
@click.option("--exclude", default=None, help="Comma-separated module-name patterns to keep dense.")
@click.option("--no-gates", is_flag=True, default=False, help="Leave out the rank gates (no rank adaptation).")
@click.option("--calibration", default=None, metavar="DATA",
              help="Data-aware init: minimize each layer's error on this text's activations "
                   "(english, python-stdlib, english+python-stdlib, a file, folder, JSONL or dataset) "
                   "[default: english+python-stdlib].")
@click.option("--calibration-seq-len", type=int, default=None, metavar="N",
              help="Tokens per calibration sequence [default: 128].")
@click.option("--no-calibration", is_flag=True, default=False,
              help="Plain TT-SVD of the weights, no calibration text (keeps far less of the model).")
@click.option("--calibration-sequences", type=int, default=None,
              help="Calibration sequences [default: 128; where compensating, as many as the "
                   "model's size allows, up to 512: MiniLM 512, a bert-base 144, 1 B parameters 128].")
@click.option("--compensate/--no-compensate", default=None,
              help="Fit each layer to the inputs the compressed layers before it produce, not to the dense "
                   "model's (calibrating block by block) [default: where --ratio cuts the factorized layers at "
                   "all: MiniLM from --ratio 1.92, a bert-base from 1.25].")
@click.option("--reconstruct-steps", type=int, default=None, metavar="N",
              help="Tune each block for N Adam steps to reproduce the dense block's outputs after the "
                   "closed-form fit (block-wise reconstruction) [default: where compensating, given 32 calibration "
                   "sequences, 300 or fewer for larger blocks: MiniLM 205 at --ratio 4, a bert-base 75; 0: off].")
@click.option("--reconstruct-lr", type=float, default=None, metavar="LR",
              help="The learning rate of block-wise reconstruction (a block that rejects its tuning is "
                   "tuned once more at 0.3 of it) [default: 1e-3].")
@click.option("--allocation", type=click.Choice(ALLOCATIONS), default=None,
              help="One shared rank (uniform); the block stack's ranks learned end to end on the calibration "
                   "text before converting (learned); per-kind rank scales searched on it (measured); or "
                   "per-layer ranks from error estimates (sensitivity) [default: uniform].")
@click.option("--ffn", type=click.Choice(FFN_METHODS), default=None,
              help="Each block's feed-forward pair as two low-rank layers, or with whole hidden neurons pruned "
                   "for the same parameters and its second layer refit on the calibration text (BERT-family "
                   "encoders) [default: prune where calibrated with a --ratio and the uniform allocation, "
                   "low-rank elsewhere].")
@click.option("--learning-steps", type=int, default=None, metavar="N",
              help="Adam steps of --allocation learned [default: by the model's size: MiniLM 100, "
                   "a bert-base 40].")
@click.option("--rank-scales", type=click.Path(exists=True, dir_okay=False), default=None, metavar="FILE",
              help="--allocation learned: the per-layer rank scales to use instead of learning them, a JSON "
                   "object of layer name -> multiple of the shared rank, or a checkpoint's comera_report.json "
                   "(its learned scales).")
@click.option("--embedding-rank-scale", type=float, default=None, metavar="X",
              help="The word embedding's ranks are X times the shared rank (the uniform allocation) "
                   "[default: 1.5].")
@click.option("--last-block-rank-scale", type=float, default=None, metavar="X",
              help="The last repeated block's layers get X times the shared rank (the uniform allocation; "
                   "a fixed --rank and the experimental allocations do not read it); 1: one shared rank "
                   "[default: 2].")
@click.option("--keep-last-attention-output/--factorize-last-attention-output", default=None,
              help="Keep the last repeated block's attention output projection dense (the uniform "
                   "allocation) [default: keep].")
@click.option("--rank-multiple", type=int, default=None,
              help="Round the ranks --ratio chooses down to multiples of this; 8 for faster bf16 on GPUs "
                   "[default: 1].")
@click.option("--dtype", default=None, metavar="DTYPE",
              help="Store the checkpoint in float32, bfloat16 or float16, or its factors as int8 (a scale per "
                   "channel) or int4 (a scale per group) [default: the source's].")
@click.option("--group-size", type=int, default=None, metavar="N",
              help="Integer storage: a scale per N values of a channel (N must divide every width) "
                   "[default: int8 per channel, int4 128].")
@click.option("--device", default=None, metavar="DEVICE",
              help="Run the decompositions on DEVICE (cuda, cuda:1); reading and writing stay on the host "
                   "[default: where the weights are].")
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
def convert(model, ratio, rank, layout, embedding_layout, word_embedding, codebook_width, d, targets, exclude,
            no_gates, calibration, calibration_seq_len, no_calibration, calibration_sequences, compensate,
            reconstruct_steps, reconstruct_lr, allocation, ffn, learning_steps, rank_scales, embedding_rank_scale,
            last_block_rank_scale, keep_last_attention_output, rank_multiple, dtype, group_size, device, recipe,
            task, out, overwrite, max_shard_size, as_json):
    """Convert MODEL (directory, hub id or alias such as minilm, bert-base) to a TT checkpoint."""
    from ..recipes import convert_options
    from ..api import convert_checkpoint

    overrides = {"ratio": ratio, "rank": rank, "layout": layout, "embedding_layout": embedding_layout,
                 "word_embedding": word_embedding, "codebook_width": codebook_width, "d": d,
                 "targets": _patterns(targets), "exclude": _patterns(exclude),
                 "gates": False if no_gates else None, "calibration": calibration,
                 "calibration_sequences": calibration_sequences, "calibration_seq_len": calibration_seq_len,
                 "allocation": allocation, "ffn": ffn, "learning_steps": learning_steps,
                 "rank_scales": _rank_scales(rank_scales) if rank_scales else None,
                 "embedding_rank_scale": embedding_rank_scale,
                 "compensate": compensate, "reconstruct_steps": reconstruct_steps, "reconstruct_lr": reconstruct_lr,
                 "last_block_rank_scale": last_block_rank_scale,
                 "keep_last_attention_output": keep_last_attention_output, "rank_multiple": rank_multiple,
                 "dtype": dtype, "group_size": group_size, "device": device}
    options = convert_options(recipe, overrides)
    if no_calibration:
        if calibration:
            raise ConfigError("give --calibration DATA or --no-calibration, not both")
        options = options.replace(calibration=None)
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
    t = result.timings
    calibrate = f"calibrate {t['calibrate']:.1f} s, " if "calibrate" in t else ""
    allocate = f"allocate {t['allocate']:.1f} s, " if "allocate" in t else ""
    out.print(f"[green]wrote[/] {result.out}  ({allocate}load {t['load']:.1f} s, {calibrate}"
              f"convert {t['convert']:.1f} s, save {t['save']:.1f} s)", soft_wrap=True)
    for note in result.notes:
        out.print(f"[yellow]note:[/] {note}", soft_wrap=True)
    if not calibrated:  # plain TT-SVD of pretrained weights keeps little of the model's function
        out.print(f"[dim]tip: calibration (the default, english+python-stdlib, or --calibration with your own "
                  f"text) fits each layer to real activations; `comera eval {result.out}` measures the result[/]",
                  soft_wrap=True)


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
    from .render import compare_table, modules_table, totals_table

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
                   "bfloat16, rounded to int8 and by HQQ to 4, 3 and 2 bits (pip install hqq), and Model2Vec "
                   "distilled from it in the compressed model's bytes (model2vec[distill]).")
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
                           progress=progress, pairs=list(pair_files), dense=_patterns(dense_patterns))
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
        click.option("--overwrite", is_flag=True, help="Replace a non-empty --out folder, or MODEL's graphs folder."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


@main.command(name="export")
@_export_options
def export(model, fmt, out, quantize, arch, opset, dtype, overwrite):
    """Export compressed MODEL for ONNX Runtime or OpenVINO, still compressed, checked against PyTorch; loads
    with SentenceTransformer(folder, backend="onnx" or "openvino") where comera_convert is not installed."""
    from ..hf.export import export_model

    start = time.perf_counter()
    with progress_display() as progress:
        result = export_model(model, out, opset=opset, dtype=dtype, quantize=quantize, arch=arch, overwrite=overwrite,
                            fmt=fmt, progress=progress)
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
