"""Training objectives: which head to load, how to batch, and the task loss L.

mlm      masked LM (encoders); a base model gets an LM head whose decoder is tied to its embedding
clm      causal LM (decoders)
distill  match the dense teacher's hidden states, layer by layer, and its mean-pooled sentence embedding
auto     the checkpoint's own: mlm for an encoder with its masked-LM head, clm for decoders, and
         distill (from the recorded source) for an encoder without an LM head, such as a sentence
         encoder saved as its base model
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..hf.sentence_config import pool


def _supports(model_type: str, mapping_name: str) -> bool:
    from transformers.models.auto import modeling_auto

    return model_type in getattr(modeling_auto, mapping_name)


def resolve_objective(objective: str, config: dict) -> str:
    model_type = config.get("model_type", "")
    masked = _supports(model_type, "MODEL_FOR_MASKED_LM_MAPPING_NAMES")
    causal = _supports(model_type, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES") and not masked
    if objective == "auto":
        return "clm" if causal else "mlm"
    if objective == "mlm" and not masked:
        raise ConfigError(f"objective mlm needs a masked-LM architecture; {model_type} is causal: "
                          "use --objective clm (or distill)")
    if objective == "clm" and not _supports(model_type, "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"):
        raise ConfigError(f"objective clm needs a causal-LM architecture; {model_type} has none: "
                          "use --objective mlm (or distill)")
    return objective


# Class-name parts of the transformers architectures that carry a language-modelling head.
LM_HEAD_MARKERS = ("MaskedLM", "CausalLM", "LMHead", "ForPreTraining")


def pick_objective(objective: str, config: dict, source: str | None) -> tuple[str, str | None]:
    """The objective to train with and, for ``auto``, a line saying what it picked and why."""
    resolved = resolve_objective(objective, config)
    if objective != "auto":
        return resolved, None
    architectures = config.get("architectures") or [config.get("model_type", "the model")]
    head = any(marker in name for name in architectures for marker in LM_HEAD_MARKERS)
    if resolved == "mlm" and not head and source:
        return "distill", (f"objective auto: distill from {source} ({architectures[0]} has no LM head; "
                           "--objective mlm adds one tied to the embedding)")
    why = ("has its LM head" if head else "is a decoder" if resolved == "clm"
           else "has no recorded source to distill from")
    return resolved, f"objective auto: {resolved} ({architectures[0]} {why})"


def task_for(objective: str) -> str:
    """The comera_convert.models task (Auto class) to load the student with."""
    return {"mlm": "mlm", "clm": "clm", "distill": "base"}[objective]


class BlockCollator:
    """Stacks packed blocks into a batch; for mlm, masks them as BERT does (15 %: 80 % [MASK],
    10 % random, 10 % kept).

    The masks of block i come from a generator seeded with (seed, i), not from the global RNG:
    a resumed run masks every block exactly as the uninterrupted run did (the data loader
    collates one batch ahead, before a checkpoint saves the RNG state).
    """

    def __init__(self, objective: str, tokenizer, mlm_probability: float, seed: int = 0):
        self.objective, self.probability, self.seed = objective, mlm_probability, seed
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.mask_id, self.vocab = tokenizer.mask_token_id, len(tokenizer)
        self.special = set(tokenizer.all_special_ids)
        if objective == "mlm" and self.mask_id is None:
            raise ConfigError("objective mlm needs a tokenizer with a mask token")

    def _mask(self, ids: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        chosen = torch.rand(ids.shape, generator=generator) < self.probability
        chosen &= ~torch.tensor([t in self.special for t in ids.tolist()])
        labels = torch.where(chosen, ids, torch.full_like(ids, -100))
        roll = torch.rand(ids.shape, generator=generator)
        random_tokens = torch.randint(self.vocab, ids.shape, generator=generator)
        masked = torch.where(chosen & (roll < 0.8), torch.full_like(ids, self.mask_id), ids)
        masked = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), random_tokens, masked)
        return masked, labels

    def __call__(self, examples: list[dict]) -> dict:
        blocks = [e["input_ids"] for e in examples]
        if self.objective == "mlm":
            pairs = [self._mask(e["input_ids"], int(e.get("index", i))) for i, e in enumerate(examples)]
            return {"input_ids": _padded([p[0] for p in pairs], self.pad_id),
                    "attention_mask": _mask_of(blocks), "labels": _padded([p[1] for p in pairs], -100)}
        batch = {"input_ids": _padded(blocks, self.pad_id), "attention_mask": _mask_of(blocks)}
        if self.objective == "clm":
            batch["labels"] = _padded(blocks, -100)  # the model shifts them
        return batch


def _padded(rows: list[torch.Tensor], value: int) -> torch.Tensor:
    """Rows right-padded with ``value`` to the longest (document starts cut short are shorter)."""
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value)


def _mask_of(rows: list[torch.Tensor]) -> torch.Tensor:
    return _padded([torch.ones_like(row) for row in rows], 0)


def _relative_mse(student_hidden, teacher_hidden, weight) -> torch.Tensor:
    """||student - teacher||^2 / ||teacher||^2 over the unmasked tokens."""
    return ((student_hidden - teacher_hidden) ** 2 * weight).sum() / (teacher_hidden ** 2 * weight).sum()


def distill_loss(student_states, teacher_states, mask) -> torch.Tensor:
    """Relative MSE of the last hidden states + (1 - cosine) of the pooled embeddings + the mean
    relative MSE of the layers in between, when both models have the same depth.

    The states are the models' ``hidden_states`` (the embedding output, then one per layer). The
    compressed student keeps the teacher's depth, so every layer gets its own target: on MiniLM at
    --ratio 4 that reaches a held-out embedding cosine of 0.80 after 150 steps where the last layer
    alone reaches 0.79, and 0.84 against 0.83 after 600 (BENCHMARKS.md, Quality).
    """
    weight = mask.unsqueeze(-1).to(student_states[-1].dtype)
    loss = _relative_mse(student_states[-1], teacher_states[-1], weight)
    cosine = F.cosine_similarity(pool(student_states[-1], mask), pool(teacher_states[-1], mask), dim=-1)
    loss = loss + (1 - cosine).mean()
    inner = list(zip(student_states[1:-1], teacher_states[1:-1]))
    if inner and len(student_states) == len(teacher_states):
        loss = loss + sum(_relative_mse(s, t, weight) for s, t in inner) / len(inner)
    return loss


def task_loss(objective: str, model, inputs: dict, teacher=None) -> torch.Tensor:
    if objective in ("mlm", "clm"):
        return model(**inputs).loss
    batch = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    mask = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))
    with torch.no_grad():
        target = teacher(**batch, output_hidden_states=True).hidden_states
    return distill_loss(model(**batch, output_hidden_states=True).hidden_states, target, mask)
