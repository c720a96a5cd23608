#!/usr/bin/env bash
# The tests that touch transformers, on the lowest and the newest release the project supports
# (pyproject.toml declares the range; hf/compat.py holds every touch of its internals). Each runs
# in a virtual environment of its own that reuses this machine's other packages.
#
#   tools/test_transformers_range.sh                 # 5.1.0 and the newest 5.x on the index
#   LOWEST=5.2.0 NEWEST=5.23.0 tools/test_transformers_range.sh
set -euo pipefail
cd "$(dirname "$0")/.."
LOWEST=${LOWEST:-5.1.0}
NEWEST=${NEWEST:-$(pip index versions transformers 2>/dev/null | sed -n 's/^transformers (\(5\.[0-9.]*\)).*/\1/p')}
TESTS=(tests/test_compat.py tests/test_checkpoint.py tests/test_convert.py tests/test_serving.py tests/test_carry.py)
for version in "$LOWEST" "$NEWEST"; do
    env="${TMPDIR:-/tmp}/comera-transformers-$version"
    python -m venv --system-site-packages "$env"
    "$env/bin/pip" install -q "transformers==$version"
    "$env/bin/pip" install -q --no-deps -e .
    echo "== transformers $version"
    "$env/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
done
