"""The conversion's stages, one class per file, each with the runner's lifecycle (``pipeline/runner.py``).

``STAGES`` is the order ``convert_checkpoint`` runs them in; the converter's module loop (factorize, dispatched
by layer kind, rounded for integer storage) runs between their preparing and their finishing. A new stage is a
file here and a line in ``STAGES``.
"""

from .allocate import Allocate
from .calibrate import Calibrate
from .read import Read
from .reconstruct import Reconstruct
from .write import Write

STAGES = (
    Allocate,  # learn the ranks on calibration text, before the source is opened with them
    Read,  # open the source (whole, streamed, block by block) and plan; stream each module's weights in
    Calibrate,  # the statistics: in memory before converting, or block by block as the loop reaches each
    Reconstruct,  # each block tuned to the dense block's outputs once converted (block by block only)
    Write,  # the spool opened, each converted module written out, the checkpoint assembled and saved
)

__all__ = ["STAGES", "Allocate", "Calibrate", "Read", "Reconstruct", "Write"]
