"""Write: where the source streams, each converted module written to a spool as it comes; at the end the model
as its checkpoint stores it (cast, or assembled from the spool), the report's records, and the checkpoint."""

from __future__ import annotations

from ...conversion.report import lineage
from ...conversion.storage import integer_storage
from ...hf.saving import save_compressed, weight_bytes
from ..runner import Conversion, Stage


class Write(Stage):
    name = "save"

    def prepare(self, job: Conversion) -> None:
        job.source.open_spool(job.out, job.plan)

    def after_module(self, job: Conversion, name: str) -> None:
        job.source.release(name)

    def finish(self, job: Conversion) -> None:
        job.source.finish_model(job.report, job.plan)
        record(job)
        job.progress(f"saving {job.out}")
        max_shard_size = job.sharding.get("max_shard_size")
        save_compressed(job.source.model, job.out, report=job.report, source=job.source.path, overwrite=job.overwrite,
                        replace_dir=True, write_weights=job.source.writer(max_shard_size), **job.sharding)


def storage_name(options) -> str | None:
    """How an integer-stored checkpoint's report names its storage ("int4, groups of 128"), or None."""
    fmt = integer_storage(options.dtype, options.group_size)
    if fmt is None:
        return None
    return fmt.name + (f", groups of {fmt.group_size}" if fmt.group_size else ", a scale per channel")


def record(job: Conversion) -> None:
    """What the report keeps of how the checkpoint was made."""
    report = job.report
    dtype = str(next(job.source.model.parameters()).dtype).removeprefix("torch.")
    report.extra["storage_dtype"] = storage_name(job.plan) or dtype
    report.extra["source_bytes"] = weight_bytes(job.source.path)
    report.extra.update(lineage(None, job.command))
