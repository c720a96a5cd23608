"""Entry point of one training-step measurement in a fresh process (its peak memory is its own)."""

import json
import sys

import torch  # noqa: F401  (imported before the baseline: the post-import memory is not the model's)
import transformers  # noqa: F401

from .models import train_step_child

if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    print(json.dumps(train_step_child(**spec)))
