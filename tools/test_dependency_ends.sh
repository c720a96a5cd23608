#!/usr/bin/env bash
# The integration tests at the ends of the dependency ranges pyproject.toml declares, each in a
# fresh virtual environment of its own (CI runs this after the README's test command):
#
#   lowest  torch 2.4.0 and transformers 5.1.0, the declared lower bounds
#   5.3     transformers 5.3.0, what model2vec[distill] pins, with the CPU torch these machines carry
#   newest  the newest torch and transformers releases inside the ranges that pip installs here, with
#           the project and every dependency (pip's resolver picks them together, as for users)
#   openvino  openvino 2025.3.0 and nncf 2.18.0, the lower bounds of the openvino extra, with the CPU
#           torch these machines carry: the OpenVINO export's tests
#
#   tools/test_dependency_ends.sh                # all four
#   ENDS="lowest" tools/test_dependency_ends.sh  # one of them
set -euo pipefail
cd "$(dirname "$0")/.."
ENDS=${ENDS:-"lowest 5.3 newest openvino"}
# What the README's commands go through: conversion (streamed and in memory), the three loading
# ways, saving, carried files, report, eval, train and decompress from the CLI, the real MiniLM.
# Their fast tests, and of the slow ones only those marked `ends` (the real MiniLM converted and
# loaded in a fresh process, a loaded model compiled): all of them at three ends overran CI's time.
INTEGRATION=(tests/test_compat.py tests/test_checkpoint.py tests/test_convert.py tests/test_serving.py
             tests/test_carry.py tests/test_streaming.py tests/test_cli.py tests/test_failures.py
             tests/test_minilm.py tests/test_int8_compute.py)

declared() {  # the requirement pyproject.toml declares for package $1, e.g. "torch>=2.4,<2.15"
    python -c 'import sys; from comera_convert.cli.failures import supported_ranges
print(sys.argv[1] + supported_ranges()[sys.argv[1]])' "$1"
}

newest() {  # "TORCH TRANSFORMERS": the newest releases inside the declared ranges that pip installs here
    # together with the project and its dependencies: pip's resolver, dependencies included, so a
    # release whose own requirements this index lacks (transformers 5.25 needs a kernels it has not)
    # and a machine-wide cap on torch hold here as they do for users.
    local report="${TMPDIR:-/tmp}/comera-ends-newest.json"
    python -m pip install --dry-run --ignore-installed --quiet --report "$report" \
        "$(declared torch)" "$(declared transformers)" -e ".[dev]" >/dev/null 2>&1
    python -c 'import json, sys
versions = {p["metadata"]["name"]: p["metadata"]["version"] for p in json.load(open(sys.argv[1]))["install"]}
print(versions["torch"], versions["transformers"])' "$report"
    rm -f "$report"
}

for end in $ENDS; do
    pins=()
    case $end in
        lowest) torch=2.4.0; transformers=5.1.0; tests=("${INTEGRATION[@]}") ;;
        5.3) torch=2.13.0; transformers=5.3.0; tests=(tests/test_compat.py tests/test_failures.py tests/test_minilm.py) ;;
        newest) read -r torch transformers < <(newest) || { echo "pip resolves no torch and transformers here" >&2; exit 1; }
                tests=("${INTEGRATION[@]}") ;;
        openvino) torch=2.13.0; transformers=5.3.0; pins=("openvino==2025.3.0" "nncf==2.18.0")
                  tests=(tests/test_openvino.py) ;;
        *) echo "unknown end $end (lowest, 5.3, newest, openvino)" >&2; exit 2 ;;
    esac
    env="${TMPDIR:-/tmp}/comera-ends-$end"
    rm -rf "$env"
    python -m venv "$env"
    echo "== $end: torch $torch, transformers $transformers"
    start=$SECONDS
    "$env/bin/pip" install -q --disable-pip-version-check "torch==$torch" "transformers==$transformers" ${pins[@]+"${pins[@]}"} -e ".[dev]" \
        >"$env.log" 2>&1 || { tail -30 "$env.log"; exit 1; }
    "$env/bin/python" -c "import torch, transformers; print('installed torch', torch.__version__, \
'transformers', transformers.__version__, 'in', $SECONDS - $start, 's')"
    "$env/bin/python" -m pytest -q -p no:cacheprovider -m "(not slow or ends) and not release" "${tests[@]}"
    rm -rf "$env" "$env.log"
done
