"""Build the documentation site (mkdocs.yml) with --strict: a broken link or anchor, a missing
page, or an undocumented public object of the API reference fails the build.

    pip install -e ".[docs]" && python tools/build_docs.py
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

# What the docs extra installs, by the module each provides.
DOCS_MODULES = {"mkdocs": "mkdocs", "material": "mkdocs-material",
                "mkdocstrings_handlers.python": "mkdocstrings[python]",
                "mkdocs_click": "mkdocs-click"}


def missing_packages(find_spec=importlib.util.find_spec) -> list[str]:
    """The docs extra's packages that are not installed."""
    missing = []
    for module, package in DOCS_MODULES.items():
        try:
            found = find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package (mkdocstrings_handlers) is not there
            found = False
        if not found:
            missing.append(package)
    return missing


def main(argv: list[str]) -> int:
    missing = missing_packages()
    if missing:
        print(f"error: the documentation needs the docs extra (missing: {', '.join(missing)}): "
              "pip install -e '.[docs]'", file=sys.stderr)
        return 2
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs 1.x prints a banner about its successor
    repo = Path(__file__).resolve().parent.parent  # mkdocs.yml, and the snippets' paths, are relative to it
    return subprocess.call([sys.executable, "-m", "mkdocs", "build", "--strict", *argv], env=env, cwd=repo)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
