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

from ..hf.onnx_export import DEFAULT_OPSET
from ..hf.openvino_export import compile_graph, require_openvino, run_graph, write_openvino_graphs

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


def openvino_methods(reference: nn.Module, compressed: nn.Module, tokenizer, progress) -> dict[str, OpenVinoEncoder]:
    """The four OpenVINO methods, their graphs written to a temporary folder, compiled, and removed."""
    require_openvino("comera bench serving's OpenVINO rows")
    methods = {}
    for names, model, where in [((DENSE_OPENVINO, DENSE_OPENVINO_INT8), reference, "dense"),
                                ((OURS_OPENVINO, OURS_OPENVINO_INT8), compressed, "comera")]:
        progress(f"exporting the {where} model to OpenVINO, float and int8")
        with tempfile.TemporaryDirectory(prefix="comera-serving-") as folder:
            graphs = write_openvino_graphs(model, tokenizer, Path(folder), opset=DEFAULT_OPSET, quantize="int8").graphs
            methods.update(zip(names, map(OpenVinoEncoder, graphs)))
    return methods
