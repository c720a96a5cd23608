"""The "comera" loading method registered with transformers without importing transformers first.

``import comera_convert`` must leave ``AutoModel.from_pretrained`` able to load a compressed
checkpoint. Registering needs transformers' quantizers package, and importing it imports
transformers' model-loading machinery, torch's compiler and the backends installed beside them
(such as hqq): about 7 s on 2 CPU cores, which ``comera --help`` and every command that fails on
its options paid before doing anything. So the method is registered the moment that package has
loaded (``from_pretrained`` always loads it first), or at once where it has loaded already.
"""

from __future__ import annotations

import importlib.abc
import sys

QUANTIZERS = "transformers.quantizers"


def register_with_transformers() -> None:
    """Register the "comera" method now if transformers' quantizers are loaded, else as they load."""
    module = sys.modules.get(QUANTIZERS)
    if module is not None and not getattr(module.__spec__, "_initializing", False):
        _register()
    elif not any(isinstance(finder, RegisterAfterLoading) for finder in sys.meta_path):
        sys.meta_path.insert(0, RegisterAfterLoading())


def _register() -> None:
    from .quantizer import register  # only once transformers' quantizers have loaded (see above)

    register()


class RegisterAfterLoading(importlib.abc.MetaPathFinder):
    """Finds transformers' quantizers package as the other finders do, with a loader that registers
    the "comera" method once the package has run; then steps out of ``sys.meta_path``."""

    def find_spec(self, name, path, target=None):
        if name != QUANTIZERS:
            return None
        spec = None
        for finder in [f for f in sys.meta_path if f is not self]:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return spec
        sys.meta_path.remove(self)  # once: the import system returns this spec and stops looking
        spec.loader = ThenRegister(spec.loader)
        return spec


class ThenRegister(importlib.abc.Loader):
    """A package's own loader, registering the "comera" method after the package has run."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        _register()

    def __getattr__(self, name):  # get_code, is_package, get_resource_reader, ...: the loader's own
        if name == "loader":  # read before __init__ set it (a copy being made): not there, no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)
