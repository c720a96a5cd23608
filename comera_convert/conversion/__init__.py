"""Model-level conversion: which modules, which ranks, the in-place swap, and its report.

targets    find candidate modules (generic walk; tied heads; patterns)
allocate   per-layer ranks meeting a whole-model ratio
calibration  input statistics for data-aware conversion (calibrate)
sensitivity  per-layer ranks from calibration error estimates
options    ConvertOptions, validated (what recipes hold)
records    module records <-> TT modules (shared by convert, save and load)
converter  convert(): the in-place swap
report     ConversionReport
"""

from .calibration import Calibration, calibrate
from .converter import convert, convert_with, count_params
from .options import ConvertOptions
from .report import ConversionReport, ModuleRow

__all__ = ["Calibration", "ConversionReport", "ConvertOptions", "ModuleRow", "calibrate", "convert", "convert_with",
           "count_params"]
