"""The names options choose from, in one torch-free module.

The CLI builds its option lists from these, so `comera --help` starts without importing torch;
the modules that act on a name (request.py, training/options.py, bench/models.py)
import it from here, so each list is written once.
"""

from __future__ import annotations

# How conversion shares the ratio's parameters out among layers (conversion/strategies.py).
ALLOCATIONS = ("uniform", "learned", "measured", "sensitivity")
# What a block's feed-forward pair becomes under a --ratio budget: two low-rank layers, or the pair
# with whole hidden neurons pruned (conversion/pruning.py).
FFN_METHODS = ("low-rank", "prune")
# How a linear layer's (or an embedding's) weight is laid out as a TT: its rows' modes then its
# columns' (tt, as CoMERA's linears), or each core mapping a row mode to a column mode (ttm).
LAYOUTS = ("tt", "ttm")
# What a checkpoint stores its tensors as (`comera convert --dtype`, conversion/storage.py): floats, or
# integers with float16 scales (the bits each).
FLOAT_STORAGE = ("float32", "bfloat16", "float16")
INTEGER_STORAGE = {"int8": 8, "int4": 4}
# What the input word table becomes: a TT, or a product-quantized codebook table.
WORD_EMBEDDINGS = ("tt", "codebook")

# Training objectives; "auto" picks one from the checkpoint (training/objectives.py).
OBJECTIVES = ("auto", "mlm", "clm", "distill")
# How distillation feeds the student's blocks (training/objectives.py): end to end, each block reads
# the student's own block before it; block-wise, each reads the teacher's hidden states before it,
# so each block learns its own block's map and no error carries from one block to the next.
DISTILL_MODES = ("end-to-end", "block-wise")
# How distillation matches each hidden state: its squared error relative to the teacher's, or
# each token's cosine distance (objectives.STATE_DISTANCES).
DISTILL_STATES = ("relative-mse", "cosine")
# How distillation matches the pooled sentence embeddings (training/objectives.py, POOLED_DISTANCES).
DISTILL_POOLED = ("cosine", "relational", "contrastive")
# Learning-rate schedules after the warm-up (transformers' names). CoMERA trains at constant rates;
# a decaying rate ends distillation on a settled model instead of a noisy iterate.
LR_SCHEDULERS = ("constant", "linear", "cosine")

# When `comera train --reproject` rewrites the low-rank pairs: once at the stage switch, or at the
# switch and at every later rank cut.
REPROJECT_AT = ("switch", "cuts")

# The late stage's loss under a --target-ratio budget: CoMERA's min-max of task loss and rank
# surrogate, or the task loss with the early stage's small rank term (the budget alone sets the size).
LATE_OBJECTIVES = ("min-max", "task")

# `comera bench`'s cases, and the models whose training step it times (random weights, each with
# its language-model head): bert-base as a masked LM, CoMERA's pre-training setting, and
# TinyLlama's shape as a causal LM, the size where the linears' GEMMs, not the host, dominate a
# GPU's step.
BENCH_CASES = ("layer", "embedding", "train-step", "convert", "inference", "serving")
EXPORT_FORMATS = ("onnx", "openvino")  # the runtimes `comera export` writes graphs for
INT8_ARCHES = ("avx512_vnni", "avx512", "avx2", "arm64")  # the CPUs sentence-transformers names int8 graphs after
# How a low-rank pair serves (layers/serving_forms.py): two products through its bond, or multiplied out.
SERVING_FORMS = ("pair", "merged")
FORM_REQUESTS = ("auto", *SERVING_FORMS)  # --forms: each timed on this machine (hf/form_timing.py), or one form
SERVING_RUNTIMES = ("openvino", "onnx")  # the runtimes forms are timed in
SPEED_RUNTIMES = ("openvino", "onnx", "torch")  # where a --target-speedup is measured (hf/gate_prices.py)
CHECKPOINT_CASES = ("inference", "serving")  # the cases --checkpoint measures; serving needs one
TRAIN_MODELS = ("bert-base", "llama-1.1b")
