"""Entry point of one training-step measurement in a fresh process (its peak memory is its own).

Everything a variant imports is imported before the baseline is taken: the peak then counts the
training's memory (weights, gradients, optimizer state, activations), not the ~140 MB of Python
modules that transformers' model and loading code and this package bring in, as CUDA's
allocated-memory peak does on GPU.
"""

import contextlib
import json
import sys

import torch  # noqa: F401
import transformers  # noqa: F401
from transformers import BertForMaskedLM  # noqa: F401  (the model classes are imported lazily)

import comera_convert  # noqa: F401

from .models import train_step_child

with contextlib.suppress(ImportError):
    import galore_torch  # noqa: F401

if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    print(json.dumps(train_step_child(**spec)))
