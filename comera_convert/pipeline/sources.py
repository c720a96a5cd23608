"""Where a conversion's weights come from: three kinds of source behind one interface, so that the
stages (``stages/``) run the same steps whichever it has.

- ``WholeSource``: the model loaded whole, calibrated in memory where the options name text, cast for
  storage at the end;
- ``StreamedSource``: the model on the meta device, each layer's weight read just before it is decomposed
  and its TT module spooled to disk (``streaming.py``, ``spool.py``);
- ``SequentialSource``: streamed, and calibrated block by block as the conversion reaches each block,
  compensating and reconstructing where the options ask (``sequential.py``, ``compensating.py``).

``open_source`` picks the kind: streamed where the checkpoint can stream (a local safetensors folder whose
allocation needs no model in memory), sequential where it also calibrates and has a stack of blocks, and
whole otherwise, with a note saying why and how much memory that takes.
"""

from __future__ import annotations

from torch import nn

from ..conversion import Calibration, ConvertPlan, ConvertRequest, plan
from ..conversion.calibration import calibrate_as_planned, plan_calibration
from ..conversion.storage import cast_for_storage, integer_storage
from ..conversion.targets import find_blocks, find_candidates
from ..hf.saving import weight_bytes
from ..models import load_model, load_tokenizer
from .compensating import CompensatingCalibration
from .sequential import SequentialCalibration
from .streaming import Streamed, streamable

# A conversion of a model loaded whole peaks at about twice its checkpoint's bytes
# (BENCHMARKS.md#conversion-time-and-memory).
WHOLE_LOAD_MEMORY = 2.0


class WholeSource:
    """The model loaded whole and converted in memory: no module step of its own."""

    streaming = False  # each module's weights read as the conversion reaches it
    blockwise = False  # calibrated block by block: each block closes (``ClosingBlock``) once converted

    def __init__(self, model: nn.Module, path: str):
        self.model, self.path = model, path

    def calibration(self, options: ConvertPlan, tokenizer, progress, on_block) -> Calibration:
        """The statistics the conversion weights its decompositions by (``options`` name calibration text);
        ``on_block`` hears of each block closing, where the calibration runs block by block."""
        progress(f"calibrating on {options.calibration}")
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.path, "--calibration")
        return calibrate_as_planned(self.model, tokenizer, options)

    def open_spool(self, out, options: ConvertPlan) -> None:
        """Before the first module is converted: where converted modules are written as they come."""

    def load(self, name: str) -> None:
        """Just before module ``name`` is decomposed: its weights read."""

    def passes(self, name: str) -> None:
        """Just before module ``name`` is decomposed: the calibration passes that fill its statistics."""

    def release(self, name: str) -> None:
        """Once module ``name``'s compressed module is in place: written out and freed."""

    def finish_calibration(self) -> None:
        """After the last module: the blocks the calibration has left, and what it still holds."""

    def finish_model(self, report, options: ConvertPlan) -> None:
        """After the last module: the model as its checkpoint stores it."""
        if options.dtype is not None:
            cast_for_storage(self.model, options.dtype)

    def writer(self, max_shard_size):
        """How the weights are written: None for ``save_pretrained``'s own way."""
        return None

    def close(self) -> None:
        """Release what the source holds open, whether the conversion finished or not."""


class StreamedSource(WholeSource):
    """The model on the meta device: each layer read just before it is decomposed, its TT module spooled."""

    streaming = True

    def __init__(self, model: nn.Module, path: str, streamed):
        super().__init__(model, path)
        self.streamed = streamed

    def open_spool(self, out, options: ConvertPlan) -> None:
        self.streamed.open_spool(out, options.dtype, integer_storage(options.dtype, options.group_size))

    def load(self, name: str) -> None:
        self.streamed.load(self.model, name)

    def release(self, name: str) -> None:
        self.streamed.spill(self.model, name)

    def finish_model(self, report, options: ConvertPlan) -> None:
        self.streamed.finish(self.model)
        report.extra["streamed"] = True

    def writer(self, max_shard_size):
        return self.streamed.writer(self.model, max_shard_size)

    def close(self) -> None:
        self.streamed.close()


class SequentialSource(StreamedSource):
    """Streamed, and calibrated block by block as the conversion reaches each block: the calibration passes run
    as the module loop reaches each block, and the calibration decides when a converted module is written out
    (a compensating one keeps its block's until the block closes)."""

    blockwise = True

    def __init__(self, model: nn.Module, path: str, streamed, blocks: str):
        super().__init__(model, path, streamed)
        self.blocks = blocks
        self.sequential: SequentialCalibration | None = None

    def calibration(self, options: ConvertPlan, tokenizer, progress, on_block) -> Calibration:
        """The text read now; the statistics are filled block by block as the conversion reaches each block."""
        progress(f"calibrating on {options.calibration}, block by block")
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.path, "--calibration")
        self.sequential = sequential_calibration(self.model, self.streamed, self.blocks, options, tokenizer, on_block)
        return self.sequential.stats

    def passes(self, name: str) -> None:
        self.sequential.passes(name)

    def release(self, name: str) -> None:
        self.sequential.release(name)

    def finish_calibration(self) -> None:
        self.sequential.finish()


def streams(path: str, options: ConvertRequest) -> bool:
    """Whether this conversion streams: one of a local safetensors checkpoint whose allocation needs no
    model in memory (uniform, or learned with its scales known)."""
    known = options.allocation == "uniform" or (options.allocation == "learned" and options.rank_scales is not None)
    return known and streamable(path)


def open_source(model_name: str, path: str, request: ConvertRequest, task, notes: list[str]) -> tuple[WholeSource,
                                                                                                     ConvertPlan]:
    """(the source, the request's plan for the source's model: on the meta device where it streams).
    Streamed where it can stream, sequential where it also calibrates; else loaded whole, with a note saying
    why."""
    if streams(path, request):
        streamed = Streamed(path)
        model = streamed.skeleton(task)
        options = plan(request, model)
        unstored = streamed.missing(model)
        blocks = find_blocks(model)
        if unstored:
            notes.append(f"{model_name} stores {unstored[0]} (and {len(unstored) - 1} more) under other names, "
                         f"which transformers converts on load: it was loaded whole instead of streamed"
                         f"{whole_load_memory(path)}")
        elif not options.calibration:
            return StreamedSource(model, path, streamed), options
        elif blocks is not None:
            return SequentialSource(model, path, streamed, blocks), options
        else:
            notes.append(f"{model_name} has no stack of repeated blocks to calibrate one at a time: it was loaded "
                         f"whole{whole_load_memory(path)}")
    model, path = load_model(model_name, task=task)
    return WholeSource(model, path), plan(request, model)


def whole_load_memory(path: str) -> str:
    source = weight_bytes(path)
    return f" (about {WHOLE_LOAD_MEMORY * source / 1e9:.1f} GB of memory)" if source else ""


def sequential_calibration(model, streamed, blocks: str, options: ConvertPlan, tokenizer,
                           on_block) -> SequentialCalibration:
    """A calibration run block by block as a streamed conversion reaches each block: compensating where the plan
    compensates or reconstructs (reconstruction needs the compressed stream too; ``on_block`` hears of each
    block it closes)."""
    candidates = find_candidates(model, options.targets, options.exclude, options.d)[0]
    text = plan_calibration(model, candidates, tokenizer, options.calibration, options.calibration_sequences,
                            options.calibration_seq_len)
    if options.compensate or options.reconstruct_steps:
        return CompensatingCalibration(model, streamed, text, candidates, blocks, options.calibration,
                                       fit_to_compressed=options.compensate, on_block=on_block)
    return SequentialCalibration(model, streamed, text, candidates, blocks, options.calibration)
