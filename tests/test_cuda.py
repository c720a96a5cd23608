"""The CUDA path: TT layers on the GPU agree with their CPU results, bf16 autocast, torch.compile,
CUDA-graph replay of a whole training step, and `comera train --compile` (skipped without a GPU)."""

from pathlib import Path

import pytest
import torch
from torch import nn

import comera_convert
from comera_convert import TTEmbedding, TTLinear

from .tiny_models import build

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _fwd_bwd(layer, x):
    x = x.clone().requires_grad_(True)
    out = layer(x)
    out.square().mean().backward()
    return out.detach().cpu(), x.grad.cpu(), [p.grad.cpu() for p in layer.parameters()]


@pytest.mark.parametrize("layout", ["tt", "ttm"])
def test_tt_linear_on_cuda_matches_cpu(layout):
    torch.manual_seed(0)
    cpu = TTLinear.from_linear(nn.Linear(96, 160), rank=8, layout=layout, gates=True)
    gpu = TTLinear.from_linear(nn.Linear(96, 160), rank=8, layout=layout, gates=True)
    gpu.load_state_dict(cpu.state_dict())
    gpu.cuda()
    x = torch.randn(4, 7, 96)
    for want, got in zip(_fwd_bwd(cpu, x), _fwd_bwd(gpu, x.cuda())):
        for w, g in zip(want if isinstance(want, list) else [want], got if isinstance(got, list) else [got]):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_bf16_autocast_tracks_the_fp32_layer():
    torch.manual_seed(0)
    layer = TTLinear.from_linear(nn.Linear(256, 512), rank=16).cuda()
    x = torch.randn(64, 256, device="cuda")
    reference = layer(x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        low = layer(x)
        low.float().square().mean().backward()
    assert low.dtype == torch.bfloat16
    relative = (low.float() - reference).norm() / reference.norm()
    assert relative < 2e-2, f"bf16 relative error {relative:.3g}"
    assert all(torch.isfinite(p.grad).all() for p in layer.parameters())


def test_compiled_layer_matches_eager():
    torch.manual_seed(0)
    layer = TTLinear.from_linear(nn.Linear(128, 384), rank=12, layout="ttm", gates=True).cuda()
    embedding = TTEmbedding.from_embedding(nn.Embedding(1000, 128), rank=12, layout="ttm").cuda()
    ids = torch.randint(0, 1000, (8, 16), device="cuda")
    eager = layer(embedding(ids))
    compiled = torch.compile(lambda i: layer(embedding(i)))
    torch.testing.assert_close(compiled(ids), eager, rtol=1e-4, atol=1e-5)


def test_cuda_graph_training_step_replays_the_eager_step():
    """The bench's captured step: replaying it trains exactly as running it eagerly does."""
    from comera_convert.bench.timing import graphed

    def setup():
        model = build("bert-mlm")
        comera_convert.convert(model, ratio=3, gates=True)
        model.cuda().train()
        model.config.hidden_dropout_prob = model.config.attention_probs_dropout_prob = 0.0
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)

    ids = torch.randint(0, model_vocab(), (4, 16), device="cuda")
    results = []
    for use_graph in (False, True):
        model, optimizer = setup()

        def step():
            optimizer.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()

        run = graphed(step) if use_graph else step
        for _ in range(5 if use_graph else 8):  # graphed() runs 3 warm-up steps itself
            run()
        results.append({k: v.detach().cpu() for k, v in model.state_dict().items()})
    for name, value in results[0].items():
        torch.testing.assert_close(results[1][name], value, rtol=1e-3, atol=1e-5, msg=name)


def model_vocab():
    return build("bert-mlm").config.vocab_size


def test_train_with_compile_and_bf16(tmp_path):
    """`comera train --compile` (torch.compile with CUDA graphs, bf16 by default on CUDA) runs and
    lowers the loss on a tiny model, with a word-level tokenizer written on the spot (no network)."""
    from transformers import BertTokenizerFast

    from comera_convert.training import TrainOptions, train

    # The package's own source as the corpus (31 K words): one file's 3 K words were too few for a
    # held-out loss that 12 steps could lower.
    text = " ".join(path.read_text() for path in sorted(Path(comera_convert.__file__).parent.rglob("*.py"))).lower()
    words = sorted({w for w in text.split() if w.isalpha()})
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(w for w in text.split() if w.isalpha()))  # every word is in the vocabulary
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words
    tokenizer = BertTokenizerFast(vocab={word: i for i, word in enumerate(vocab)})
    model = build("bert-mlm")
    model.resize_token_embeddings(len(tokenizer))
    # --ratio 3: at 2 the codebook word table (2172 words, half the tiny model) takes the whole cut and
    # leaves no TT layer for the rank gates to train.
    comera_convert.convert(model, ratio=3, gates=True)
    path = tmp_path / "tt"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    options = TrainOptions(objective="mlm", data=str(corpus), steps=12, seq_len=32, batch_size=4, lr_cores=2e-3,
                           lr_rest=2e-3, logging_steps=4, save_steps=12, max_eval_blocks=8, compile=True)
    result = train(str(path), options, tmp_path / "out")
    assert result.held_out_after < result.held_out_before
    assert comera_convert.from_pretrained(tmp_path / "out").config.vocab_size == len(tokenizer)


def test_a_tt_training_step_makes_no_host_syncs():
    """Forward, backward, AdamW and CoMERA's gate pruning stay on the device (CUDA graphs need it)."""
    from comera_convert.training import TrainOptions
    from comera_convert.training.plan import plan_training
    from comera_convert.training.rank_control import RankController

    model = build("bert-mlm")
    comera_convert.convert(model, ratio=3, gates=True)
    controller = RankController(model, plan_training(TrainOptions(), "mlm"), dense_params=1)
    model.cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), device="cuda")

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        for _, module in controller.modules:
            module.zero_pruned_()

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # Pruning then runs on the moved model (its one host sync is the count): one entry pushed below
    # tau closes, and only that one.
    _, module = controller.modules[0]
    open_before = module.ranks
    with torch.no_grad():
        module.gates[0][0] = 0.0
    assert controller.prune() == 1
    assert module.ranks[0] == open_before[0] - 1 and module.ranks[1:] == open_before[1:]


def test_calibrated_conversion_on_cuda_matches_cpu():
    """Calibration hooks and the weighted decompositions run where the model is."""
    from comera_convert.conversion.calibration import collect
    from comera_convert.conversion.targets import find_candidates

    batches = [torch.randint(0, 40, (4, 16)) for _ in range(4)]
    held_out = torch.randint(0, 40, (2, 16))
    outputs = []
    for device in ("cpu", "cuda"):
        model = build("bert").to(device)
        stats = collect(model, find_candidates(model)[0], batches, source="test")
        comera_convert.convert(model, ratio=2, calibration=stats)
        with torch.no_grad():
            outputs.append(model(input_ids=held_out.to(device)).last_hidden_state.cpu())
    # cuSOLVER's and LAPACK's float32 eigendecompositions differ in the last digits; a few of the
    # outputs moved by 1.7e-3 on an H100 (a wrong device path would move them by the output's scale).
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-2, atol=5e-3)


def test_bench_compiled_and_cut_variants_of_the_llama_step(tmp_path):
    """The 8x variants of the 1.1 B step, tiny: cut from 4x as --target-ratio cuts, and converted at
    8x under torch.compile, each graphed and compared with dense run the same way."""
    import json

    from click.testing import CliRunner

    from comera_convert.cli import main

    path = tmp_path / "bench.json"
    result = CliRunner().invoke(main, ["bench", "train-step", "--quick", "--device", "cuda", "--dtype", "bfloat16",
                                       "--model", "llama-1.1b", "--json", str(path),
                                       "--variant", "TT --ratio 4 cut to 8x, ranks of 8 + CUDA graph",
                                       "--variant", "TT --ratio 8, ranks of 8 + compile + CUDA graph"])
    assert result.exit_code == 0, result.output
    rows = {r["method"]: r for r in json.loads(path.read_text())["rows"]}
    assert set(rows) == {"dense AdamW", "dense AdamW + CUDA graph", "dense AdamW + compile + CUDA graph",
                         "TT --ratio 4 cut to 8x, ranks of 8 + CUDA graph",
                         "TT --ratio 8, ranks of 8 + compile + CUDA graph"}
    assert all("error" not in r for r in rows.values()), rows
    dense = rows["dense AdamW"]["params"]
    assert rows["TT --ratio 4 cut to 8x, ranks of 8 + CUDA graph"]["params"] <= dense / 8
