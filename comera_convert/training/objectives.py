"""Training objectives: which head to load, how to batch, and the task loss L.

mlm      masked LM (encoders); a base model gets an LM head whose decoder is tied to its embedding
clm      causal LM (decoders)
distill  match the dense teacher's hidden states, layer by layer, and its mean-pooled sentence embedding:
         end to end (each student block reads the block before it), or block-wise (each student block
         reads the teacher's hidden states before it, so each learns its own block's map)
auto     the checkpoint's own: mlm for an encoder with its masked-LM head, clm for decoders, and
         distill (from the recorded source) for an encoder without an LM head, such as a sentence
         encoder saved as its base model
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..conversion.targets import find_blocks
from ..errors import ConfigError
from ..hf.sentence_config import pool
from ..pipeline.sequential import hidden_of


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


def _token_cosine_distance(student_hidden, teacher_hidden, weight) -> torch.Tensor:
    """1 - cosine of each token's student and teacher states, averaged over the unmasked tokens: the
    direction of every state, which mean pooling reads, with no hidden dimension ruling by its size."""
    cosine = F.cosine_similarity(student_hidden.float(), teacher_hidden.float(), dim=-1)
    tokens = weight.squeeze(-1).float()
    return ((1 - cosine) * tokens).sum() / tokens.sum()


# How a hidden state is matched (``TrainOptions.distill_states``).
STATE_DISTANCES = {"relative-mse": _relative_mse, "cosine": _token_cosine_distance}

# The temperature of the in-batch similarities: sentence-transformers' ranking losses score cosines times
# 20, which is how sentence encoders such as all-MiniLM-L6-v2 were trained to separate their texts.
SIMILARITY_TEMPERATURE = 0.05


def _pooled_cosine(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """1 - cosine of each text's student and teacher embeddings, averaged over the batch."""
    return (1 - F.cosine_similarity(student, teacher, dim=-1)).mean()


def _relational(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """The pooled cosine + how far the student's in-batch similarity structure is from the teacher's: for each
    text, the KL divergence from the teacher's softmax over its similarities to the batch's other texts to
    the student's (what retrieval ranks by), at ``SIMILARITY_TEMPERATURE``."""
    others = ~torch.eye(student.shape[0], dtype=torch.bool, device=student.device)
    if not others.any():  # one text a batch has no structure to match
        return _pooled_cosine(student, teacher)

    def log_ranks(embeddings):
        unit = F.normalize(embeddings.float(), dim=-1)
        scores = (unit @ unit.t() / SIMILARITY_TEMPERATURE)[others].reshape(len(unit), -1)
        return F.log_softmax(scores, dim=-1)

    structure = F.kl_div(log_ranks(student), log_ranks(teacher), log_target=True, reduction="batchmean")
    return _pooled_cosine(student, teacher) + structure


def _contrastive(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """The pooled cosine + each student embedding's cross-entropy at picking its own text's teacher embedding
    among the batch's (InfoNCE against the teacher, at ``SIMILARITY_TEMPERATURE``)."""
    scores = F.normalize(student.float(), dim=-1) @ F.normalize(teacher.float(), dim=-1).t()
    own = torch.arange(len(scores), device=scores.device)
    return _pooled_cosine(student, teacher) + F.cross_entropy(scores / SIMILARITY_TEMPERATURE, own)


# How the pooled sentence embeddings are matched (``TrainOptions.distill_pooled``).
POOLED_DISTANCES = {"cosine": _pooled_cosine, "relational": _relational, "contrastive": _contrastive}


def distill_loss(student_states, teacher_states, mask, states: str = "relative-mse",
                 pooled: str = "cosine") -> torch.Tensor:
    """The last hidden states' distance + the pooled embeddings' distance + the mean distance of the layers
    in between, when both models have the same depth; ``states`` names the states' distance
    (STATE_DISTANCES: the relative MSE, or each token's cosine distance), ``pooled`` the embeddings'
    (POOLED_DISTANCES: 1 - cosine, alone or with the batch's similarity structure or a contrastive term).

    The states are the models' ``hidden_states`` (the embedding output, then one per layer). The
    compressed student keeps the teacher's depth, so every layer gets its own target, which distils to
    a higher held-out embedding cosine than the last layer alone (docs/findings.md).
    """
    distance = STATE_DISTANCES[states]
    weight = mask.unsqueeze(-1).to(student_states[-1].dtype)
    loss = distance(student_states[-1], teacher_states[-1], weight)
    loss = loss + POOLED_DISTANCES[pooled](pool(student_states[-1], mask), pool(teacher_states[-1], mask))
    inner = list(zip(student_states[1:-1], teacher_states[1:-1]))
    if inner and len(student_states) == len(teacher_states):
        loss = loss + sum(distance(s, t, weight) for s, t in inner) / len(inner)
    return loss


def blockwise_distill_loss(student: "BlockStates", teacher: "BlockStates", mask,
                           states: str = "relative-mse", pooled: str = "cosine") -> torch.Tensor:
    """The mean distance (``states``, as in ``distill_loss``) of every state (what the first block
    reads, then each block's output, each block having read the teacher's states before it) + the
    distance (``pooled``) of the pooled last hidden states."""
    distance = STATE_DISTANCES[states]
    weight = mask.unsqueeze(-1).to(student.last.dtype)
    pairs = list(zip(student.states, teacher.states))
    loss = sum(distance(s, t, weight) for s, t in pairs) / len(pairs)
    return loss + POOLED_DISTANCES[pooled](pool(student.last, mask), pool(teacher.last, mask))


def model_blocks(model) -> torch.nn.ModuleList:
    """The model's stack of blocks (under a DDP wrapper too), or a ConfigError naming the model."""
    inner = getattr(model, "module", model)
    name = find_blocks(inner)
    if name is None:
        raise ConfigError(f"block-wise distillation needs a stack of repeated blocks; "
                          f"{type(inner).__name__} has none: use --distill-mode end-to-end")
    return inner.get_submodule(name)


@dataclass
class BlockStates:
    """A forward pass seen block by block: ``states`` is what the first block read, then each block's
    output; ``last`` the model's last hidden state (after a final norm, where it has one)."""

    states: list
    last: torch.Tensor

    @property
    def inputs(self) -> list:
        """What each block read (block i: states[i])."""
        return self.states[:-1]


def block_states(model, batch: dict, feed: list | None = None) -> BlockStates:
    """Run ``model`` on ``batch``, recording its blocks' states by hooks (not ``output_hidden_states``,
    whose first entry some transformers releases take from the first block's arguments); with
    ``feed``, block i reads ``feed[i]`` in place of the state before it."""
    stack = model_blocks(model)
    if feed is not None:
        check_depths(len(stack), len(feed))
    states: list = []

    def before(index):
        def hook(module, args, kwargs):
            if index == 0:
                states.append(args[0] if args else kwargs["hidden_states"])
            if feed is None:
                return None
            return ((feed[index], *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": feed[index]})
        return hook

    def after(module, args, output):
        states.append(hidden_of(output))

    hooks = [block.register_forward_pre_hook(before(i), with_kwargs=True) for i, block in enumerate(stack)]
    hooks += [block.register_forward_hook(after) for block in stack]
    try:
        last = model(**batch).last_hidden_state
    finally:
        for handle in hooks:
            handle.remove()
    return BlockStates(states, last)


def task_loss(objective: str, model, inputs: dict, teacher=None, blockwise: bool = False,
              states: str = "relative-mse", pooled: str = "cosine") -> torch.Tensor:
    """The objective's loss; ``blockwise`` (distill only): every student block reads the teacher's
    hidden states before it (``blockwise_distill_loss``); ``states``: how distillation matches a
    hidden state (STATE_DISTANCES); ``pooled``: the pooled embeddings (POOLED_DISTANCES)."""
    if objective in ("mlm", "clm"):
        return model(**inputs).loss
    batch = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
    mask = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))
    if not blockwise:
        with torch.no_grad():
            target = teacher(**batch, output_hidden_states=True).hidden_states
        return distill_loss(model(**batch, output_hidden_states=True).hidden_states, target, mask, states, pooled)
    with torch.no_grad():
        target = block_states(teacher, batch)
    return blockwise_distill_loss(block_states(model, batch, feed=target.inputs), target, mask, states, pooled)


def require_same_depth(student, teacher) -> None:
    """Before training: block-wise distillation feeds student block i the teacher's states before block i."""
    check_depths(len(model_blocks(student)), len(model_blocks(teacher)))


def check_depths(student_blocks: int, teacher_blocks: int) -> None:
    if student_blocks != teacher_blocks:
        raise ConfigError(f"block-wise distillation needs a teacher as deep as the student: the student has "
                          f"{student_blocks} blocks, the teacher {teacher_blocks}")
