"""The single-process parts of --fsdp (training/fsdp.py): the main worker's unsharded twin of the
model, and masks that multiply sharded cores. The sharded training runs themselves are in
test_train.py (torchrun, two CPU workers)."""

import pytest
import torch

import comera_convert
from comera_convert.layers.base import placed_like
from comera_convert.training.fsdp import fill, meta_twin

from .tiny_models import build, outputs


@pytest.mark.parametrize("convert", [False, True])
def test_the_twin_takes_the_gathered_weights_and_keeps_ties(convert):
    model = build("bert-mlm")  # the decoder's weight and bias are tied to the embedding's
    if convert:
        comera_convert.convert(model, ratio=2)
    twin = meta_twin(model)
    assert all(p.is_meta for p in twin.parameters())
    assert all(not b.is_meta for b in twin.buffers())  # buffers are not sharded: copied as they are
    state = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("cls.predictions.decoder")}
    fill(twin, state)  # a tied parameter found under its other name
    assert torch.equal(outputs(twin), outputs(model))
    if not convert:
        assert twin.cls.predictions.decoder.weight is twin.bert.embeddings.word_embeddings.weight
    assert not any(p.is_meta for p in twin.parameters())


def test_a_parameter_the_gather_did_not_bring_is_named():
    model = build("llama-clm")
    state = model.state_dict()
    del state["model.norm.weight"]
    with pytest.raises(KeyError, match="model.norm.weight"):
        fill(meta_twin(model), state)


def test_a_mask_for_a_whole_tensor_is_the_mask_itself():
    mask, core = torch.ones(4), torch.randn(3, 4)
    assert placed_like(mask, core) is mask
