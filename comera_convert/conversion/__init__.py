"""Model-level conversion, in torch alone: which modules, which ranks, the in-place swap, its report.

targets      find candidate modules (generic walk; tied heads; patterns)
allocate     per-layer ranks meeting a whole-model ratio
strategies   the allocation strategies (uniform; experimental/ holds the opt-in studies)
calibration  input statistics for data-aware conversion (calibrate)
plan         plan(request, model): every default derived once, with its reason
records      module records <-> TT modules (shared by convert, save and load)
converter    convert_modules(): the in-place swap
hooks        ModuleHooks: progress, and streaming, each module's weights handed in and its TT module taken out
report       ConversionReport

Nothing here imports transformers: ``comera_convert.convert`` (api.py) adds what makes the
result a transformers model that saves and loads compressed (hf/).
"""

from .calibration import Calibration, calibrate
from .converter import convert_modules
from .model_facts import count_params
from ..request import ConvertOptions, ConvertRequest
from .plan import ConvertPlan, plan
from .report import ConversionReport, ModuleRow

__all__ = ["Calibration", "ConversionReport", "ConvertOptions", "ConvertPlan", "ConvertRequest", "ModuleRow",
           "calibrate", "convert_modules", "count_params", "plan"]
