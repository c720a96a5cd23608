#!/usr/bin/env bash
# Served where embedding users serve: `comera export --quantize int8` of a converted
# sentence-transformers model, for ONNX Runtime and for OpenVINO, each loaded by sentence-transformers'
# backend of that name in a fresh environment that has sentence-transformers[onnx] or
# sentence-transformers[openvino] (the extras docs/jobs.md names) and not comera_convert; the
# embeddings, float and int8, are compared with the ones comera_convert computes in PyTorch.
#
#   tools/serving_smoke.sh              # CI runs it after the test suites
#   SERVING_VENV=DIR OPENVINO_VENV=DIR tools/serving_smoke.sh   # reuse environments made by an earlier run
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# A tiny converted BERT saved as a sentence-transformers model (mean pooling, unit length), exported.
PYTHONPATH="$root" python - "$work" <<'PY'
import json, sys
from pathlib import Path

import torch
from transformers import BertConfig, BertModel

import comera_convert
from comera_convert.hf.sentence_config import sentence_embeddings
from tests.tiny_models import word_tokenizer

work = Path(sys.argv[1])
torch.manual_seed(0)
model = BertModel(BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=128, max_position_embeddings=64))
comera_convert.convert(model, ratio=3, uncalibrated=True)
folder = work / "model"
model.save_pretrained(folder)
tokenizer = word_tokenizer(500)
tokenizer.save_pretrained(folder)
modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
           {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
           {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
(folder / "modules.json").write_text(json.dumps(modules))
(folder / "1_Pooling").mkdir()
(folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                              "pooling_mode_mean_tokens": True}))
(folder / "2_Normalize").mkdir()
(folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32, "do_lower_case": False}))
texts = ["w11 w12 w13", "w14 w15 w16 w17 w18 w19", "w200 w300"]
batch = tokenizer(texts, padding=True, return_tensors="pt")
loaded = comera_convert.from_pretrained(str(folder)).eval()
embeddings = torch.nn.functional.normalize(sentence_embeddings(loaded, batch), dim=-1)
(work / "expected.json").write_text(json.dumps({"texts": texts, "embeddings": embeddings.tolist()}))
PY
comera --quiet export "$work/model" --out "$work/onnx" --quantize int8 --arch avx2 >"$work/export.log" 2>&1 \
    || { tail -20 "$work/export.log"; exit 1; }
comera --quiet export "$work/model" --format openvino --out "$work/openvino" --quantize int8 \
    >"$work/export.log" 2>&1 || { tail -20 "$work/export.log"; exit 1; }

# A fresh environment with sentence-transformers and one backend's extra: make_env DIR EXTRA
make_env() {
    [ -x "$1/bin/python" ] && return
    python -m venv "$1"
    # optimum-onnx and optimum-intel, which sentence-transformers' backends load through, take
    # transformers below 4.58: named here so that pip does not walk back through every release.
    "$1/bin/pip" install -q --disable-pip-version-check "torch==2.13.0" "sentence-transformers[$2]" \
        "transformers<4.58" >"$work/install.log" 2>&1 || { tail -30 "$work/install.log"; exit 1; }
    # optimum-intel pulls torchvision, whose wheel on the index is built for CUDA torch and fails to
    # load beside the CPU build; transformers runs without it.
    "$1/bin/pip" uninstall -q -y torchvision >/dev/null 2>&1 || true
}

# Loads each graph in the backend's environment and compares: check ENV BACKEND FOLDER FILE...
check() {
    local venv=$1 backend=$2 folder=$3
    shift 3
    (cd "$work" && "$venv/bin/python" - "$work" "$backend" "$folder" "$@" <<'PY'
import importlib.util, json, sys
from pathlib import Path

import numpy as np
from sentence_transformers import SentenceTransformer

work, backend, folder, files = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
assert importlib.util.find_spec("comera_convert") is None, "this environment must not have comera_convert"
expected = json.loads((work / "expected.json").read_text())
want = np.array(expected["embeddings"])
for file in files:
    least = 0.99 if "int8" in file else 0.9999
    model = SentenceTransformer(str(work / folder), backend=backend, model_kwargs={"file_name": file}, device="cpu")
    got = model.encode(expected["texts"])
    cosine = (got * want).sum(axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosine.min() >= least, f"{file}: cosine to comera_convert's embeddings {cosine.min():.5f} < {least}"
    print(f"{file}: sentence-transformers' {backend} backend, cosine to PyTorch's embeddings >= {cosine.min():.5f}")
PY
    )
}

onnx_venv=${SERVING_VENV:-$work/venv-onnx}
make_env "$onnx_venv" onnx
check "$onnx_venv" onnx onnx onnx/model.onnx onnx/model_quint8_avx2.onnx
openvino_venv=${OPENVINO_VENV:-$work/venv-openvino}
make_env "$openvino_venv" openvino
check "$openvino_venv" openvino openvino openvino/openvino_model.xml openvino/openvino_model_qint8_quantized.xml
