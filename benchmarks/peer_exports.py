"""The zero-effort routes a serving record compares against: sentence-transformers' own int8 exports of a
dense model, each made in a fresh environment of its own, as a user makes them.

    python benchmarks/peer_exports.py minilm --out /tmp/peers/minilm
    # then: comera bench serving --checkpoint ... --peer /tmp/peers/minilm/onnx/model_qint8_avx512_vnni.onnx \
    #           --peer /tmp/peers/minilm/openvino/openvino_model_qint8_quantized.xml

- ``onnx/model_qint8_<arch>.onnx`` (``model_quint8_avx2.onnx``):
  ``export_dynamic_quantized_onnx_model(model, "<arch>", out)`` of the model
  loaded with ``backend="onnx"`` (optimum exports it), ``arch`` this CPU's most capable;
- ``openvino/openvino_model_qint8_quantized.xml``: ``export_static_quantized_openvino_model(model,
  OVQuantizationConfig(), out)`` of the model loaded with ``backend="openvino"`` (optimum-intel converts it),
  calibrated, as that function calibrates, on 300 texts padded to 384 tokens; the texts are the training
  split of the package's english corpus, because its default data set (glue/sst2) is on the Hub.

The environments (``--envs``, kept for later runs) take sentence-transformers[onnx] or [openvino] (and datasets)
with the CPU build of torch; optimum-onnx and optimum-intel take transformers below 4.58. The model is named as
``comera convert`` names it (an alias such as ``minilm`` or ``all-mpnet-base-v2``, or a folder).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from itertools import islice
from pathlib import Path

from comera_convert.hf.onnx_int8 import this_machine_arch
from comera_convert.models import resolve
from comera_convert.text import training_documents

CALIBRATION_TEXTS = 300  # OVQuantizationConfig's num_samples
# What each backend's environment installs: sentence-transformers' extra, and for the OpenVINO export the
# datasets package its quantization takes the calibration texts through (as its error message asks).
BACKENDS = {"onnx": ["sentence-transformers[onnx]"], "openvino": ["sentence-transformers[openvino]", "datasets"]}
TORCH = "torch==2.13.0"  # the CPU build on the machines' disk; a newer one would pull CUDA wheels
TRANSFORMERS = "transformers<4.58"  # what optimum-onnx and optimum-intel take

# Runs in the backend's environment: argv = backend, model folder, out folder, arch, calibration texts file.
EXPORT = r'''
import json, sys
from sentence_transformers import SentenceTransformer
backend, model_path, out, arch, texts_file = sys.argv[1:]
model = SentenceTransformer(model_path, backend=backend, device="cpu")
if backend == "onnx":
    from sentence_transformers import export_dynamic_quantized_onnx_model
    export_dynamic_quantized_onnx_model(model, arch, out)
else:
    import datasets
    from optimum.intel import OVConfig, OVQuantizationConfig, OVQuantizer
    from sentence_transformers.backend.utils import save_or_push_to_hub_model
    texts = [json.loads(line)["text"] for line in open(texts_file)]
    config = OVQuantizationConfig()
    quantizer = OVQuantizer.from_pretrained(model.transformers_model)
    tokenized = datasets.Dataset.from_dict({"sentence": texts}).map(
        lambda batch: model.tokenizer(batch["sentence"], padding="max_length", max_length=384, truncation=True),
        batched=True, remove_columns=["sentence"])
    save_or_push_to_hub_model(
        export_function=lambda save_dir: quantizer.quantize(tokenized, save_directory=save_dir,
                                                            ov_config=OVConfig(quantization_config=config)),
        export_function_name="export_static_quantized_openvino_model", config=config, model_name_or_path=out,
        push_to_hub=False, create_pr=False, file_suffix="qint8_quantized", backend="openvino", model=model)
'''


def environment(folder: Path, backend: str) -> Path:
    """A virtual environment with sentence-transformers[backend] (made once); its python."""
    python = folder / backend / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(python.parent.parent)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", TORCH,
                        *BACKENDS[backend], TRANSFORMERS], check=True)
        # optimum-intel pulls torchvision, whose wheel on the index is built for CUDA torch and fails to load
        # beside the CPU build; transformers runs without it.
        subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision"], check=False)
    return python


def calibration_file(out: Path) -> Path:
    """The OpenVINO export's calibration texts, a JSON line each."""
    file = out / "calibration.jsonl"
    texts = islice(training_documents("english"), CALIBRATION_TEXTS)
    file.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return file


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="an alias (minilm, all-mpnet-base-v2) or a model folder")
    parser.add_argument("--out", type=Path, required=True, help="the folder the exports go in")
    parser.add_argument("--envs", type=Path, default=Path.home() / ".cache" / "comera-peer-envs",
                        help="where the backends' environments are made, and found by later runs")
    parser.add_argument("--backend", choices=list(BACKENDS), action="append",
                        help="only this backend (repeatable)")
    args = parser.parse_args(argv)
    model = resolve(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    texts = calibration_file(args.out)
    for backend in args.backend or BACKENDS:
        python = environment(args.envs, backend)
        print(f"exporting {args.model} with sentence-transformers[{backend}]", file=sys.stderr, flush=True)
        subprocess.run([str(python), "-c", EXPORT, backend, str(model), str(args.out), this_machine_arch(),
                        str(texts)], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    for file in sorted(args.out.rglob("*int8*")):
        print(file)


if __name__ == "__main__":
    main()
