"""The OpenVINO side of `comera bench serving`: the dense and the compressed model exported as
`comera export --format openvino` exports them, float and int8, each behind the call a transformers
encoder answers, so that the serving benchmark times and scores them beside the other methods.

Both int8 graphs are quantized alike: NNCF's static quantization for transformers, calibrated on the
package's english corpus (``hf/openvino_export.py``), which is how sentence-transformers'
``export_static_quantized_openvino_model`` quantizes a dense model (through optimum-intel, calibrated on a
data set from the Hub). ``--peer`` adds graphs made elsewhere, such as that export itself.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from ..hf.openvino_export import require_openvino, write_openvino_graphs
from ..hf.runtimes import compile_graph, run_graph

DENSE_OPENVINO = "dense, OpenVINO"
DENSE_OPENVINO_INT8 = "dense, OpenVINO int8 (NNCF, as sentence-transformers quantizes)"
OURS_OPENVINO, OURS_OPENVINO_INT8 = "comera, OpenVINO", "comera, OpenVINO int8"


class OpenVinoEncoder(nn.Module):
    """An OpenVINO compiled model answering ``model(input_ids=..., attention_mask=...).last_hidden_state``, in
    the precision OpenVINO picks for this CPU (bfloat16 where it has the instructions), as it serves."""

    def __init__(self, file: Path):
        super().__init__()
        weights = file.with_suffix(".bin")
        self.megabytes = round((file.stat().st_size + weights.stat().st_size) / 2 ** 20, 1)
        self.compiled = compile_graph(file)  # holds the weights: the files may go
        self.anchor = nn.Parameter(torch.zeros(0), requires_grad=False)  # retrieval.embed() reads the device

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, **_):
        given = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
        feeds = {name: value.numpy() for name, value in given.items() if value is not None}
        return SimpleNamespace(last_hidden_state=torch.from_numpy(run_graph(self.compiled, feeds)))


def openvino_methods(model: nn.Module, names: tuple[str, str], tokenizer, progress,
                     forms: str | None = None) -> dict[str, OpenVinoEncoder]:
    """``model``'s float and int8 OpenVINO methods under ``names``, the graphs written to a temporary folder,
    compiled, and removed: a compressed model's layers in ``forms`` (``form_timing.plan_forms``), a dense
    one's (``forms`` None) every linear in int8, as sentence-transformers quantizes it."""
    require_openvino("comera bench serving's OpenVINO rows")
    progress(f"exporting {names[0]} to OpenVINO, float and int8")
    with tempfile.TemporaryDirectory(prefix="comera-serving-") as folder:
        result = write_openvino_graphs(model, tokenizer, Path(folder), quantize="int8", forms=forms or "pair")
        return with_forms(dict(zip(names, map(OpenVinoEncoder, result.graphs))), result, forms)


def with_forms(methods: dict, result, forms: str | None) -> dict:
    """``methods`` (each a graph of ``result``), each told the serving forms its graph was written in, where
    they were chosen for a compressed model (``serving_forms.json``'s plans, summed up by choice)."""
    if forms is not None:
        for method, graph in zip(methods.values(), result.graphs):
            groups = result.forms["graphs"][graph.name]["groups"]
            chosen = {}
            for group in groups:
                chosen[group["chosen"]] = chosen.get(group["chosen"], 0) + len(group["layers"])
            method.forms = ", ".join(f"{choice} x{count}" for choice, count in chosen.items())
    return methods
