"""The ONNX Runtime side of `comera bench serving`: the dense and the compressed model exported as
`comera export-onnx` exports them, float and int8, each behind the call a transformers encoder answers,
so that the serving benchmark times and scores them beside the PyTorch methods.

The dense model's int8 graph is quantized exactly as sentence-transformers'
``export_dynamic_quantized_onnx_model`` quantizes its ONNX export (``hf/onnx_int8.py``, without the
preparation a compressed graph gets): the int8 route a sentence-transformers user takes for the dense
model, though exported by torch's exporter rather than optimum's. ``peer_methods`` adds graphs made
elsewhere, such as that export itself made by sentence-transformers in an environment of its own.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from ..hf.onnx_export import write_graphs
from ..hf.onnx_int8 import require_onnxruntime, this_machine_arch
from .openvino_serving import OpenVinoEncoder, with_forms

DENSE_ONNX, DENSE_ONNX_INT8 = "dense, ONNX Runtime", "dense, ONNX Runtime int8 (sentence-transformers' quantization)"
OURS_ONNX, OURS_ONNX_INT8 = "comera, ONNX Runtime", "comera, ONNX Runtime int8"
PEER = "peer: "  # how the name of a graph made elsewhere begins


class OnnxEncoder(nn.Module):
    """An onnxruntime session answering ``model(input_ids=..., attention_mask=...).last_hidden_state``."""

    def __init__(self, file: Path):
        import onnxruntime

        super().__init__()
        self.megabytes = round(file.stat().st_size / 2 ** 20, 1)  # the session holds the graph: the file may go
        self.session = onnxruntime.InferenceSession(str(file), providers=["CPUExecutionProvider"])
        self.input_names = [i.name for i in self.session.get_inputs()]
        # retrieval.embed() reads the device from a parameter: an empty one, on the CPU
        self.anchor = nn.Parameter(torch.zeros(0), requires_grad=False)

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, **_):
        if token_type_ids is None:  # what transformers' encoders take when none is given: one segment
            token_type_ids = torch.zeros_like(input_ids)
        given = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
        feeds = {name: given[name].numpy() for name in self.input_names}
        return SimpleNamespace(last_hidden_state=torch.from_numpy(self.session.run(None, feeds)[0]))


def onnx_methods(model: nn.Module, names: tuple[str, str], tokenizer, progress,
                 forms: str | None = None) -> dict[str, OnnxEncoder]:
    """``model``'s float and int8 ONNX Runtime methods under ``names``, the graphs written to a temporary folder,
    read, and removed: a compressed model's layers in ``forms`` (``form_timing.plan_forms``), a dense one's
    (``forms`` None) quantized as sentence-transformers quantizes its export, every linear in int8 and the
    graph as it is."""
    require_onnxruntime("comera bench serving")
    arch = this_machine_arch()
    progress(f"exporting {names[0]} to ONNX, float32 and int8 for {arch}")
    with tempfile.TemporaryDirectory(prefix="comera-serving-") as folder:
        result = write_graphs(model, tokenizer, Path(folder), quantize="int8", arch=arch, prepare=forms is not None,
                              forms=forms or "pair")
        return with_forms(dict(zip(names, map(OnnxEncoder, result.graphs))), result, forms)


def peer_methods(files) -> dict[str, nn.Module]:
    """A method for each graph made elsewhere, named after its folder and file: ONNX Runtime runs an .onnx
    file, OpenVINO an .xml one."""
    return {f"{PEER}{file.parent.name}/{file.name}": (OpenVinoEncoder if file.suffix == ".xml" else OnnxEncoder)(file)
            for file in map(Path, files)}


def graph_megabytes(model: nn.Module) -> float | None:
    """The size of an ONNX or OpenVINO method's graph files, None for a PyTorch method."""
    return getattr(model, "megabytes", None)
