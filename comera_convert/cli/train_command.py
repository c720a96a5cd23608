"""`comera train`: rank-adaptive continued pre-training (a thin shell over comera_convert.training)."""

from __future__ import annotations

import time

import click

from ..training.options import TrainOptions
from .dataclass_options import SectionedCommand, flags_from
from .group import main
from .commands import command_line
from .console import console, echo_json, progress_console, show_library_logs


def _rich_progress_callback(total_steps: int, tokens_per_step: int | None, minutes: float | None = None):
    """A TrainerCallback drawing a rich progress bar with loss, ratio and tokens/s: over the steps, or
    over the seconds of a --minutes budget. Steps/s instead where steps differ in tokens
    (``tokens_per_step`` None: document starts cut short)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
    from transformers import TrainerCallback

    class RichProgress(TrainerCallback):
        def __init__(self):
            self.bar = None
            self.start = None

        def on_train_begin(self, args, state, control, **kwargs):
            stderr = progress_console()
            if state.is_world_process_zero and stderr is not None:
                self.bar = Progress(TextColumn("[bold]training" + (" (seconds)" if minutes else "")), BarColumn(),
                                    MofNCompleteColumn(), TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                                    console=stderr)
                total = round(minutes * 60) if minutes else total_steps
                self.task = self.bar.add_task("train", total=total, completed=0 if minutes else state.global_step,
                                              info="")
                self.bar.start()
                self.start, self.first_step = time.perf_counter(), state.global_step

        def _done(self, state) -> int:
            return round(time.perf_counter() - self.start) if minutes else state.global_step

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.bar is None or not logs or "ratio" not in logs:
                return
            elapsed = max(time.perf_counter() - self.start, 1e-9)
            steps = (state.global_step - self.first_step) / elapsed
            rate = f"{steps * tokens_per_step:,.0f} tok/s" if tokens_per_step else f"{steps:.1f} steps/s"
            info = (f"loss {logs.get('task_loss', logs.get('loss', float('nan'))):.3f}  "
                    f"ratio {logs['ratio']:.2f}x  {rate}  {logs.get('stage', '')}")
            self.bar.update(self.task, completed=self._done(state), info=info)

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(self.task, completed=self._done(state))

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.stop()

    return RichProgress()


@main.command(cls=SectionedCommand)
@click.argument("model")
@flags_from(TrainOptions)
@click.option("--recipe", default=None, metavar="NAME|FILE",
              help="A training recipe: a packaged one by name (`comera recipes`) or a YAML file.")
@click.option("--out", type=click.Path(), required=True, help="Output directory (checkpoints go in out/checkpoints).")
@click.option("--resume", is_flag=True, help="Resume from the last checkpoint in OUT/checkpoints.")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty output directory.")
@click.option("--max-shard-size", default=None, metavar="SIZE",
              help="Split the weights into files of at most SIZE (e.g. 2GB), with an index [default: 50GB].")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of tables.")
def train(model, recipe, out, resume, overwrite, as_json, max_shard_size, **given):
    """Continue pre-training a compressed MODEL while CoMERA adapts its TT ranks."""
    from ..recipes import train_options
    from ..training import train as run_training
    from ..training.run import leave_process_group

    options = train_options(recipe, given)
    show_library_logs()  # what --objective auto picked, the stage switch, a missed target
    tokens = options.batch_size * options.gradient_accumulation_steps * options.seq_len
    if options.varies_lengths:
        tokens = None  # starts cut short or kept long: steps read other counts than whole blocks, the bar counts steps
    result = run_training(model, options, out, resume=resume, overwrite=overwrite,
                          callbacks=[_rich_progress_callback(options.steps, tokens, options.minutes)],
                          command=command_line(),
                          max_shard_size=max_shard_size)
    leave_process_group()
    if result.report is None:
        return  # not the main process of a distributed run
    if as_json:
        echo_json(result.to_dict())
        return
    from .render import modules_table

    printer = console()
    printer.print(modules_table(result.report, printer.width, by_block=False))
    target = "" if result.target_ratio is None else (
        f" (target {result.target_ratio:g}x, {'missed' if result.shortfall else 'reached'})")
    printer.print(f"objective {result.objective}, {result.steps} steps: held-out loss "
                  f"{result.held_out_before:.4f} -> {result.held_out_after:.4f}; ratio "
                  f"{result.ratio_before:.2f}x -> {result.ratio_after:.2f}x{target}")
    if result.speed_after is not None:
        before, after = result.speed_before, result.speed_after
        printer.print(f"speed against the dense model in {after['runtime']} (its fastest form: {after['dense_form']}), "
                      f"measured: {before['speedup']:.2f}x -> {after['speedup']:.2f}x ± {after['speedup_error']:.2f} "
                      f"(target {result.target_speedup:g}x, {'missed' if result.shortfall else 'reached'})")
    for cut in result.rank_cuts:
        printer.print(f"step {cut['step']}: closed ranks cut out, {cut['params_before'] / 1e6:.2f} M -> "
                      f"{cut['params_after'] / 1e6:.2f} M parameters stored; {seconds_per_step(cut)}")
    if result.cosine_after is not None:
        printer.print(f"held-out sentence-embedding cosine to the teacher {result.cosine_before:.3f} -> "
                      f"{result.cosine_after:.3f} (packed blocks; `comera eval {result.out}` for texts as written)")
    if result.task_pairs:
        printer.print(f"held-out retrieval, share of the teacher's recall@1 kept ({result.task_pairs} pairs: a "
                      f"passage's first sentence against the rest) {result.task_before:.3f} -> {result.task_after:.3f}")
    printer.print(f"[green]wrote[/] {result.out} (curve: {result.out / 'training_curve.png'})")


def seconds_per_step(cut: dict) -> str:
    """A rank cut's mean step time before and after it, in words (a side the run has no steps of: n/a)."""
    before, after = (cut[f"step_seconds_{side}"] for side in ("before", "after"))
    shown = [f"{value:.3f} s" if value is not None else "n/a" for value in (before, after)]
    return f"step time {shown[0]} -> {shown[1]}"
