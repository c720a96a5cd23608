"""`comera train`: rank-adaptive continued pre-training (a thin shell over comera_convert.training)."""

from __future__ import annotations

import time

import click

from ..choices import DISTILL_MODES, DISTILL_STATES, LATE_OBJECTIVES, LR_SCHEDULERS, OBJECTIVES, REPROJECT_AT
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


OPTION_NAMES = ["objective", "data", "steps", "minutes", "seq_len", "batch_size", "gradient_accumulation_steps",
                "lr_cores", "lr_gates", "lr_rest", "beta", "tau", "rank_multiple", "early_steps", "target_ratio",
                "teacher", "distill_mode", "distill_states", "logging_steps", "save_steps", "seed", "warmup_steps",
                "lr_scheduler_type", "dropout", "document_starts", "start_min_tokens", "start_max_tokens",
                "gradient_checkpointing", "bf16", "compile", "fsdp", "cut_ranks", "reproject", "reproject_at",
                "budget_share", "late_objective", "last_block_floor", "weight_decay", "plateau_window", "plateau_tol",
                "target_fraction", "target_loss", "late_weighted_sum", "late_rank_weight", "mlm_probability",
                "max_nan_steps", "max_eval_blocks"]


@main.command()
@click.argument("model")
@click.option("--data", default=None,
              help="Text file, directory, JSONL, dataset name, or a built-in corpus: english [default], "
                   "python-stdlib, english+python-stdlib (both, for distillation).")
@click.option("--objective", type=click.Choice(OBJECTIVES), default=None,
              help="Task loss [default: auto].")
@click.option("--max-steps", "--steps", "steps", type=int, default=None, help="Optimizer steps [default: 1000].")
@click.option("--minutes", type=float, default=None,
              help="Wall-time budget: stop when it is spent or at --steps, whichever comes first; the "
                   "learning rate decays over the first of the two.")
@click.option("--target-ratio", type=float, default=None,
              help="Whole-model ratio to reach by the end: ranks close by importance over the late stage "
                   "(scheduled in steps, or with --minutes in the time spent).")
@click.option("--late-objective", type=click.Choice(LATE_OBJECTIVES), default=None,
              help="The late stage's loss under --target-ratio: CoMERA's min-max of task loss and rank "
                   "surrogate, or the task loss alone (the budget sets the size) [default: task].")
@click.option("--budget-share", type=float, default=None,
              help="Share of the late stage over which --target-ratio closes ranks; the rest trains at "
                   "the final ranks [default: 0.15].")
@click.option("--last-block-floor", type=float, default=None,
              help="Share of its rank at the start that each bond of the last block keeps under "
                   "--target-ratio [default: 0.25, as every bond].")
@click.option("--seq-len", type=int, default=None, help="Tokens per packed block [default: 128].")
@click.option("--per-device-train-batch-size", "--batch-size", "batch_size", type=int, default=None,
              help="Blocks per step and device [default: 8].")
@click.option("--gradient-accumulation-steps", type=int, default=None)
@click.option("--lr-cores", type=float, default=None,
              help="AdamW rate of the compressed layers' factors: TT cores and pruned layers' weights "
                   "[default: 1e-4; 1e-3 to distill].")
@click.option("--lr-gates", type=float, default=None, help="AdamW rate of the rank gates [default: 1e-3].")
@click.option("--lr-rest", type=float, default=None,
              help="AdamW rate of dense parameters [default: 5e-5; 1e-4 to distill].")
@click.option("--beta", type=float, default=None, help="Weight of the rank term, early stage [default: 0.01].")
@click.option("--tau", type=float, default=None, help="Gate pruning threshold [default: 1e-2].")
@click.option("--rank-multiple", type=int, default=None,
              help="Prune so that open ranks stay multiples of this, e.g. 8 for bf16 GPUs [default: 1].")
@click.option("--early-steps", type=int, default=None,
              help="Steps of the early stage [default: 2/3 of steps, 5 % with --target-ratio].")
@click.option("--teacher", default=None, help="Dense teacher for distill [default: the recorded source].")
@click.option("--distill-mode", type=click.Choice(DISTILL_MODES), default=None,
              help="Feed each student block the student's own states (end-to-end) or the teacher's "
                   "(block-wise: each block learns its own map) [default: end-to-end].")
@click.option("--distill-states", type=click.Choice(DISTILL_STATES), default=None,
              help="Match each hidden state by its squared error relative to the teacher's, or by each "
                   "token's cosine distance [default: cosine where the conversion cut the float "
                   "factorized layers 3x or more, else relative-mse].")
@click.option("--logging-steps", type=int, default=None)
@click.option("--save-steps", type=int, default=None)
@click.option("--warmup-steps", type=int, default=None)
@click.option("--lr-scheduler-type", type=click.Choice(LR_SCHEDULERS), default=None,
              help="Learning rates after the warm-up: held (CoMERA) or decayed to 0 "
                   "[default: constant; cosine to distill].")
@click.option("--dropout", type=float, default=None,
              help="Every dropout probability while training [default: the model's; 0 to distill].")
@click.option("--document-starts", type=float, default=None,
              help="Share of training draws that are a document's first block [default: 0, packed blocks "
                   "only; 0.5 to distill a sentence encoder].")
@click.option("--start-min-tokens", type=int, default=None,
              help="Cut each drawn document start to its first k tokens, k log-uniform from this to the "
                   "block's length (short texts, as an encoder embeds them) [default: whole blocks].")
@click.option("--start-max-tokens", type=int, default=None,
              help="Keep document starts up to this many tokens, past --seq-len (long texts, as an encoder "
                   "embeds them up to 256) [default: --seq-len].")
@click.option("--gradient-checkpointing", is_flag=True, default=None,
              help="Recompute each layer's activations in backward: less memory, more compute.")
@click.option("--seed", type=int, default=None)
@click.option("--weight-decay", type=float, default=None, metavar="X",
              help="AdamW's weight decay on the cores and the dense rest; the gates have none [default: 0.01].")
@click.option("--plateau-window", type=int, default=None, metavar="N",
              help="Also switch stages once the loss's smoothed gain over N steps falls below --plateau-tol "
                   "[default: 0, off].")
@click.option("--plateau-tol", type=float, default=None, metavar="X",
              help="The relative gain under which --plateau-window switches stages [default: 1e-3].")
@click.option("--target-fraction", type=float, default=None, metavar="X",
              help="Without --target-ratio: the late stage's size target as this share of the TT size at the "
                   "switch (CoMERA's) [default: 0.2].")
@click.option("--target-loss", type=float, default=None, metavar="L",
              help="The late stage's loss target L0 [default: the smoothed loss at the switch].")
@click.option("--late-weighted-sum", type=float, default=None, metavar="X",
              help="Weight of the weighted-sum term (loss + beta * rank surrogate) added to the late stage's "
                   "min-max step [default: 0.1].")
@click.option("--late-rank-weight", type=float, default=None, metavar="X",
              help="Weight of the rank surrogate when size is the worse-off objective of the late stage "
                   "[default: 1].")
@click.option("--mlm-probability", type=float, default=None, metavar="P",
              help="Share of tokens masked for the mlm objective [default: 0.15].")
@click.option("--max-nan-steps", type=int, default=None, metavar="N",
              help="Consecutive non-finite losses tolerated (each step skipped) before stopping [default: 5].")
@click.option("--max-eval-blocks", type=int, default=None, metavar="N",
              help="Held-out blocks the loss is measured on [default: 64].")
@click.option("--bf16/--no-bf16", default=None,
              help="bf16 autocast [default: on with CUDA, or on a CPU with AVX512-BF16 or AMX].")
@click.option("--compile", is_flag=True, default=None, help="torch.compile with CUDA graphs (fixed shapes).")
@click.option("--fsdp", is_flag=True, default=None,
              help="Shard parameters, gradients and optimizer state across the workers (FSDP2; under torchrun).")
@click.option("--cut-ranks/--no-cut-ranks", default=None,
              help="Cut closed ranks out of the cores while training, so steps get cheaper as ranks close "
                   "[default: on; never under torchrun].")
@click.option("--reproject/--no-reproject", default=None,
              help="At the stage switch, rewrite the low-rank pairs in the basis their inputs order, so "
                   "--target-ratio closes the directions that carry least [default: on with --target-ratio].")
@click.option("--reproject-at", type=click.Choice(REPROJECT_AT), default=None,
              help="Re-project once at the switch, or at the switch and at every later rank cut "
                   "[default: switch].")
@click.option("--recipe", default=None, metavar="NAME|FILE",
              help="A training recipe: a packaged one by name (`comera recipes`) or a YAML file.")
@click.option("--out", type=click.Path(), required=True, help="Output directory (checkpoints go in out/checkpoints).")
@click.option("--resume", is_flag=True, help="Resume from the last checkpoint in OUT/checkpoints.")
@click.option("--overwrite", is_flag=True, help="Replace a non-empty output directory.")
@click.option("--max-shard-size", default=None, metavar="SIZE",
              help="Split the weights into files of at most SIZE (e.g. 2GB), with an index [default: 50GB].")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of tables.")
def train(model, recipe, out, resume, overwrite, as_json, max_shard_size, **values):
    """Continue pre-training a compressed MODEL while CoMERA adapts its TT ranks."""
    from ..recipes import train_options
    from ..training import train as run_training
    from ..training.run import leave_process_group

    options = train_options(recipe, {k: values[k] for k in OPTION_NAMES})
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
