"""How a checkpoint's graph is made, side by side: OpenVINO's PyTorch frontend against the ONNX graph converted
by OpenVINO, and each low-rank pair as two products, multiplied out, or in the form timed fastest here
(`comera export --forms`), each float and int8 and the dense source the same ways, every graph timed in the
same rounds on the held-out english pairs' documents. Writes one record.

    python benchmarks/graph_routes.py minilm-tt4 --name graph-routes-minilm --pairs PAIRS/english.jsonl

Speeds are medians of the rounds' ratios against the dense model's OpenVINO graph in its default precision,
with their standard error; the last column says how much faster each int8 graph runs than its own float
graph (the gain int8 brings to the form).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record as records  # noqa: E402

from comera_convert.bench.openvino_serving import OpenVinoEncoder  # noqa: E402
from comera_convert.bench.serving import length_sorted_batches, round_ratios, timed_rounds  # noqa: E402
from comera_convert.evaluation import load_compared  # noqa: E402
from comera_convert.hf.onnx_export import eager_attention, write_graphs  # noqa: E402
from comera_convert.hf.openvino_export import quantize_static, write_openvino_graphs  # noqa: E402
from comera_convert.retrieval import read_pairs  # noqa: E402

BASE = "dense, frontend"  # the graph every speed is a ratio of: the dense model as optimum-intel converts it


def onnx_route(model, tokenizer, folder: Path) -> list[Path]:
    """The model exported to ONNX as `comera export` exports it, converted by OpenVINO, and quantized as the
    OpenVINO export quantizes (NNCF, calibrated on the english corpus): float and int8 graphs."""
    import openvino

    with eager_attention(model):
        onnx_file = write_graphs(model, tokenizer, folder / "onnx", forms="pair").graphs[0]
    graph = openvino.convert_model(str(onnx_file))
    files = [folder / "route-onnx.xml", folder / "route-onnx-int8.xml"]
    openvino.save_model(graph, str(files[0]), compress_to_fp16=False)
    openvino.save_model(quantize_static(graph, tokenizer), str(files[1]), compress_to_fp16=False)
    return files


def graphs(compared, folder: Path) -> dict[str, Path]:
    """Every route's float and int8 graph by name."""
    made = {}
    for where, model, routes in (("dense", compared.reference, ("pair",)),
                                 ("comera", compared.compressed, ("pair", "merged", "auto"))):
        for forms in routes:
            directory = folder / f"{where}-{forms}"
            directory.mkdir()
            name = f"{where}, frontend" + (f", forms {forms}" if where == "comera" else "")
            made.update(zip((name, f"{name}, int8"),
                            write_openvino_graphs(model, compared.tokenizer, directory, quantize="int8",
                                                  forms=forms).graphs))
        directory = folder / f"{where}-onnx"
        directory.mkdir()
        made.update(zip((f"{where}, through ONNX", f"{where}, through ONNX, int8"),
                        onnx_route(model, compared.tokenizer, directory)))
    return made


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a compressed checkpoint (its recorded source is the dense model)")
    parser.add_argument("--name", required=True, help="the record's name: benchmarks/results/NAME.json")
    parser.add_argument("--title", default=None)
    parser.add_argument("--pairs", type=Path, required=True, help="JSONL pairs whose documents are embedded")
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--results", type=Path, default=records.RESULTS, help="where the record is written")
    args = parser.parse_args(argv)
    records.exit_unless_committed()  # the record's commit must reproduce it

    compared = load_compared(args.checkpoint, None, "graph_routes.py")
    documents = [document for _, document in read_pairs(args.pairs, args.texts)]
    batches = length_sorted_batches(compared.tokenizer, documents, args.batch)
    with tempfile.TemporaryDirectory(prefix="graph-routes-") as folder:
        methods = {name: OpenVinoEncoder(file) for name, file in graphs(compared, Path(folder)).items()}
    rounds = timed_rounds(methods, batches, args.repeats)
    against = round_ratios(rounds, BASE)
    rows = []
    for name, model in methods.items():
        float_name = name.removesuffix(", int8")
        gain = [f / i for f, i in zip(rounds[float_name], rounds[name])] if name.endswith(", int8") else None
        rows.append({"graph": name, "sentences_per_s": round(len(documents) / statistics.median(rounds[name]), 1),
                     "speed": records.cell(round(against[name][0], 2), round(against[name][1], 3)),
                     "int8_gain": round(statistics.median(gain), 2) if gain else None, "file_mb": model.megabytes})
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    title = args.title or (f"{compared.source} and {args.checkpoint} in OpenVINO: the PyTorch frontend against "
                           "the ONNX graph, and the pairs' serving forms")
    record = records.new_record(
        args.name, title, shlex.join(["python", "benchmarks/graph_routes.py", *argv]),
        [("graph", "graph"), ("sentences_per_s", "sentences/s", ".1f"), ("speed", "vs dense frontend", ".2f"),
         ("int8_gain", "int8 over its float graph", ".2f"), ("file_mb", "MB", ".1f")], rows,
        notes=[f"{len(documents)} texts ({tokens / len(documents):.0f} tokens on average), batches of {args.batch}, "
               f"{args.repeats} rounds, every graph in each; OpenVINO's default precision for the float graphs"])
    print(records.write(record, args.results))


if __name__ == "__main__":
    main()
