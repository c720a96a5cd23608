#!/usr/bin/env bash
# The release as users get it: build the sdist and the wheel, install the wheel (not editable) into a
# fresh virtual environment outside the checkout, and use it from there: convert the packaged MiniLM
# with a recipe by name, load the result with transformers after `import comera_convert`, report it.
#
#   tools/wheel_smoke.sh            # CI runs it after the test suites
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python -m build --outdir "$work/dist" "$root" >"$work/build.log" 2>&1 || { tail -30 "$work/build.log"; exit 1; }
wheel=$(ls "$work"/dist/comera_convert-*.whl)
ls "$work"/dist/comera_convert-*.tar.gz >/dev/null
python -m venv "$work/venv"
"$work/venv/bin/pip" install -q --disable-pip-version-check "torch==2.13.0" "$wheel[demo]" >"$work/install.log" 2>&1 \
    || { tail -30 "$work/install.log"; exit 1; }
cd "$work"                                   # nothing of the checkout on the path
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
version=$(venv/bin/python -c "import comera_convert; print(comera_convert.__version__)")
# Output goes to a file before grep reads it: `grep -q` stops reading at its first match, and a
# command still writing into the closed pipe exits non-zero, which pipefail turns into a failure.
venv/bin/comera --version >version.txt
grep -q "version $version" version.txt
venv/bin/comera convert minilm --recipe minilm-ratio4 --calibration-sequences 32 --out minilm-tt4 >convert.log 2>&1 \
    || { tail -20 convert.log; exit 1; }
venv/bin/python - <<'PY'
import pathlib

import torch
from transformers import AutoModel, AutoTokenizer

import comera_convert

installed = pathlib.Path(comera_convert.__file__).resolve()
assert "site-packages" in installed.parts, f"comera_convert imported from {installed}, not the wheel"
model = AutoModel.from_pretrained("minilm-tt4").eval()
assert any(isinstance(m, comera_convert.TTModule) for m in model.modules()), "no compressed layer was loaded"
tokenizer = AutoTokenizer.from_pretrained("minilm-tt4")
with torch.no_grad():
    hidden = model(**tokenizer(["a sentence from the wheel"], return_tensors="pt")).last_hidden_state
assert torch.isfinite(hidden).all()
print(f"wheel {comera_convert.__version__} from {installed.parent}: loaded {type(model).__name__} compressed")
PY
venv/bin/comera report minilm-tt4 >report.txt
grep -qi "smaller" report.txt
grep -q "plan: the options derived" report.txt
echo "wheel smoke test passed: $(basename "$wheel")"
