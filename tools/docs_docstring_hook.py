"""An mkdocs hook: every object the API reference documents, and each of its public members, has a
docstring. A missing one is a warning, which ``mkdocs build --strict`` turns into a failed build."""

from __future__ import annotations

import logging
import re

import griffe

log = logging.getLogger("mkdocs.hooks.docstrings")  # under "mkdocs.", so --strict counts its warnings
IDENTIFIER = re.compile(r"^:::\s+([\w.]+)\s*$", re.MULTILINE)


def on_page_markdown(markdown: str, page, config, files):
    """Check each ``::: identifier`` of the page before mkdocstrings renders it."""
    for identifier in IDENTIFIER.findall(markdown):
        if identifier.startswith("mkdocs-click"):
            continue
        for name in undocumented(identifier):
            log.warning(f"{page.file.src_path}: {name} has no docstring")
    return markdown


def undocumented(identifier: str) -> list[str]:
    """The public objects under ``identifier`` (itself, a class's public methods and properties, a
    module's public functions and classes) that have no docstring."""
    package, _, _ = identifier.partition(".")
    root = griffe.load(package, resolve_aliases=False)
    obj = root[identifier.removeprefix(package + ".")] if identifier != package else root
    missing = []
    for member in [obj, *_public_members(obj)]:
        if not member.docstring or not member.docstring.value.strip():
            missing.append(member.path)
    return missing


def _public_members(obj) -> list:
    if not (obj.is_class or obj.is_module):
        return []
    members = []
    for name, member in obj.members.items():
        if name.startswith("_") or member.is_alias or member.is_attribute:
            continue
        if member.is_function or member.is_class:
            members.append(member)
    return members
