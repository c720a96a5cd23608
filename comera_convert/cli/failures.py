"""Failures the project did not foresee, as one line: which dependency failed, its version, and the
range comera-convert supports (a release inside the declared range that moved an internal, or a
release outside it that another package pinned); ``COMERA_TRACEBACK=1`` shows the traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PROJECT = "comera-convert"
PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # comera_convert/
TRACEBACK_VARIABLE = "COMERA_TRACEBACK"


def supported_ranges() -> dict[str, str]:
    """The version range pyproject.toml declares for each required distribution, by lower-case name."""
    try:
        requirements = metadata.requires(PROJECT) or []
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return {}
    ranges = {}
    for line in requirements:
        requirement = Requirement(line)
        if requirement.marker is not None and "extra" in str(requirement.marker):
            continue  # an optional extra's requirement
        bounds = sorted(map(str, requirement.specifier), key=lambda bound: not bound.startswith(">"))
        ranges[canonicalize_name(requirement.name)] = ",".join(bounds)  # lower bound first: >=5.1,<6
    return ranges


def _distribution_of(module_name: str) -> str | None:
    top = module_name.partition(".")[0]
    names = metadata.packages_distributions().get(top)
    return names[0] if names else None


def _module_of(filename: str) -> str | None:
    """The dotted module a frame's file belongs to, where it lies in site-packages or this package."""
    path = Path(filename).resolve()
    if path.is_relative_to(PACKAGE_ROOT):
        return "comera_convert." + ".".join(path.relative_to(PACKAGE_ROOT).with_suffix("").parts)
    for root in map(Path, sys.path):
        if root.name in ("site-packages", "dist-packages") and path.is_relative_to(root.resolve()):
            return ".".join(path.relative_to(root.resolve()).with_suffix("").parts)
    return None


def failing_dependency(error: BaseException) -> tuple[str, str] | None:
    """(distribution, where) of the dependency ``error`` came out of: the first frame of another
    distribution below comera_convert's last frame (the library comera called), or the module an
    ImportError could not import; None where the error arose in comera_convert itself."""
    frames = traceback.extract_tb(error.__traceback__)
    modules = [_module_of(frame.filename) for frame in frames]
    ours = [i for i, module in enumerate(modules) if module and module.startswith("comera_convert.")]
    for frame, module in list(zip(frames, modules))[(ours[-1] + 1 if ours else 0):]:
        distribution = module and _distribution_of(module)
        if distribution and distribution.lower() != PROJECT:
            return distribution, f"{module}.{frame.name}"
    if isinstance(error, ImportError) and error.name:
        distribution = _distribution_of(error.name)
        if distribution and distribution.lower() != PROJECT:
            return distribution, f"import {error.name}"
    return None


def describe_failure(error: BaseException) -> str:
    """One line for an unforeseen error: the dependency, its version and the supported range, or
    an internal error of comera-convert's."""
    cause = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".rstrip(": ")
    hint = f"set {TRACEBACK_VARIABLE}=1 for the traceback"
    found = failing_dependency(error)
    if found is None:
        return f"internal error in {PROJECT}: {cause} ({hint}, and please report it)"
    distribution, where = found
    version = metadata.version(distribution)
    supported = supported_ranges().get(canonicalize_name(distribution))
    promise = (f"{PROJECT} supports {distribution}{supported}" if supported is not None
               else f"{distribution} is not a declared dependency of {PROJECT}")
    return f"{distribution} {version} failed in {where}: {cause} ({promise}; {hint})"


def show_traceback() -> bool:
    return os.environ.get(TRACEBACK_VARIABLE, "") not in ("", "0")
