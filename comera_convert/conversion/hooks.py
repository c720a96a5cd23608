"""ModuleHooks: what a conversion tells whoever runs it, module by module, in one object.

A model in memory needs none of them. The streamed pipeline (``pipeline/``) hands the weights in and takes
the modules out: ``load(name)`` just before a module's weights are decomposed, ``release(name)`` once its
TT module is in place (it is written out and freed). ``progress(name, index, count)`` hears of each module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


def _unheard(name: str, index: int, count: int) -> None:
    """No one listening to the progress."""


@dataclass(frozen=True)
class ModuleHooks:
    progress: Callable[[str, int, int], None] = _unheard
    load: Callable[[str], None] | None = None  # None: the weights are in memory already
    release: Callable[[str], None] | None = None  # None: the converted modules stay in the model

    @property
    def streaming(self) -> bool:
        """Whether the weights are read as the conversion reaches each module (and let go after it)."""
        return self.load is not None


IN_MEMORY = ModuleHooks()
