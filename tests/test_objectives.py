import pytest
import torch

from comera_convert.training.objectives import distill_loss


def states(layers, seed):
    """hidden_states of a fake model: the embedding output, then one (2, 5, 8) tensor per layer."""
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 5, 8, generator=generator) for _ in range(layers + 1))


def test_distill_loss_is_zero_only_when_every_layer_matches():
    teacher = states(3, seed=0)
    mask = torch.ones(2, 5, dtype=torch.long)
    assert float(distill_loss(teacher, teacher, mask)) == pytest.approx(0.0, abs=1e-6)
    # Same last layer, another middle layer: the layer-wise term sees it, the last-layer terms do not.
    student = teacher[:2] + (teacher[2] + 1.0,) + teacher[3:]
    middle = ((student[2] - teacher[2]) ** 2).sum() / (teacher[2] ** 2).sum()
    assert float(distill_loss(student, teacher, mask)) == pytest.approx(float(middle) / 2, rel=1e-5)


def test_a_teacher_of_another_depth_is_matched_at_the_last_layer_only():
    teacher, student = states(3, seed=0), states(2, seed=1)
    student = student[:-1] + (teacher[-1],)
    mask = torch.ones(2, 5, dtype=torch.long)
    assert float(distill_loss(student, teacher, mask)) == pytest.approx(0.0, abs=1e-6)


def test_padding_tokens_do_not_count():
    teacher = states(2, seed=0)
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[:, -1] = 0
    student = tuple(t.clone() for t in teacher)
    for s in student:
        s[:, -1] += 10.0  # only where the mask is 0
    assert float(distill_loss(student, teacher, mask)) == pytest.approx(0.0, abs=1e-6)


def tiny_bert(seed, layers=3):
    import transformers

    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=100)
    torch.manual_seed(seed)
    return transformers.BertModel(config).eval()


def test_block_states_feed_each_block_the_teacher_states_before_it():
    """Block i of the student, fed the teacher's states, gives what a teacher with the student's
    block i in place gives at layer i (the recorded states also match transformers' hidden_states)."""
    from comera_convert.training.objectives import block_states

    teacher, student = tiny_bert(0), tiny_bert(1)
    batch = {"input_ids": torch.randint(5, 100, (2, 7)), "attention_mask": torch.ones(2, 7, dtype=torch.long)}
    batch["attention_mask"][1, 5:] = 0
    with torch.no_grad():
        target = block_states(teacher, batch)
        hidden = teacher(**batch, output_hidden_states=True).hidden_states
        assert len(target.states) == len(hidden) == 4
        assert all(torch.allclose(a, b) for a, b in zip(target.states, hidden))
        fed = block_states(student, batch, feed=target.inputs)
        own = student(**batch, output_hidden_states=True).hidden_states
        assert torch.allclose(fed.states[0], own[0])  # the student's own embedding output
        for index in range(3):
            mixed = tiny_bert(0)
            mixed.encoder.layer[index].load_state_dict(student.encoder.layer[index].state_dict())
            expected = mixed(**batch, output_hidden_states=True).hidden_states[index + 1]
            assert torch.allclose(fed.states[index + 1], expected, atol=1e-5)
            assert not torch.allclose(fed.states[index + 1], own[index + 1], atol=1e-3)
    assert not student.encoder.layer[0]._forward_pre_hooks  # the hooks are gone


def test_blockwise_loss_is_zero_for_the_teacher_and_trains_each_block_alone():
    from comera_convert.training.objectives import task_loss

    teacher, student = tiny_bert(0), tiny_bert(1)
    batch = {"input_ids": torch.randint(5, 100, (2, 7)), "attention_mask": torch.ones(2, 7, dtype=torch.long)}
    assert float(task_loss("distill", teacher, batch, teacher, blockwise=True)) == pytest.approx(0.0, abs=1e-6)
    loss = task_loss("distill", student.train(), batch, teacher, blockwise=True)
    loss.backward()
    # Each block's input is the teacher's, detached: block 0's loss reaches the embeddings, and every
    # block gets a gradient of its own.
    assert student.embeddings.word_embeddings.weight.grad is not None
    assert all(layer.output.dense.weight.grad.abs().sum() > 0 for layer in student.encoder.layer)
    assert all(p.grad is None for p in teacher.parameters())


def test_blockwise_needs_a_teacher_as_deep_as_the_student():
    from comera_convert.errors import ConfigError
    from comera_convert.training.objectives import task_loss

    batch = {"input_ids": torch.randint(5, 100, (2, 7))}
    with pytest.raises(ConfigError, match="the student has 3 blocks, the teacher 2"):
        task_loss("distill", tiny_bert(1), batch, tiny_bert(0, layers=2), blockwise=True)


def test_the_cosine_state_distance_reads_each_tokens_direction():
    """distill_states="cosine": 1 - cosine per token, averaged over the unmasked tokens; a token's
    state scaled keeps its direction and costs nothing, where the relative MSE charges it."""
    import torch.nn.functional as F

    teacher = states(2, seed=0)
    mask = torch.ones(2, 5, dtype=torch.long)
    scaled = tuple(t * 3.0 for t in teacher)
    assert float(distill_loss(scaled, teacher, mask, states="cosine")) == pytest.approx(0.0, abs=1e-6)
    assert float(distill_loss(scaled, teacher, mask, states="relative-mse")) > 1.0
    # Another middle layer only: the mean over the inner layers of its tokens' cosine distance.
    student = teacher[:1] + (states(0, seed=3)[0],) + teacher[2:]
    expected_middle = (1 - F.cosine_similarity(student[1], teacher[1], dim=-1)).mean()
    assert float(distill_loss(student, teacher, mask, states="cosine")) == pytest.approx(float(expected_middle),
                                                                                          rel=1e-5)
    mask[:, -1] = 0
    padded = tuple(t.clone() for t in teacher)
    for s in padded:
        s[:, -1] = -s[:, -1]  # opposite direction, only where the mask is 0
    assert float(distill_loss(padded, teacher, mask, states="cosine")) == pytest.approx(0.0, abs=1e-6)


def test_the_pooled_embeddings_structure_is_what_relational_distillation_matches():
    from comera_convert.training.objectives import POOLED_DISTANCES, SIMILARITY_TEMPERATURE

    generator = torch.Generator().manual_seed(0)
    teacher = torch.randn(6, 16, generator=generator)
    cosine, relational, contrastive = (POOLED_DISTANCES[name] for name in ("cosine", "relational", "contrastive"))
    assert float(relational(teacher, teacher)) == pytest.approx(0.0, abs=1e-6)
    # rotated as a whole: every text's cosine to its teacher falls, the batch's similarity structure stays
    rotation = torch.linalg.qr(torch.randn(16, 16, generator=generator))[0]
    rotated = teacher @ rotation
    assert float(cosine(rotated, teacher)) > 0.5
    assert float(relational(rotated, teacher)) == pytest.approx(float(cosine(rotated, teacher)), abs=1e-5)
    # each text moved a little towards another: close by cosine, its neighbours changed
    shuffled = 0.8 * teacher + 0.6 * teacher[torch.tensor([1, 0, 3, 2, 5, 4])]
    assert float(relational(shuffled, teacher)) - float(cosine(shuffled, teacher)) > 0.1
    # contrastive: its own text's teacher embedding among the batch's, at the temperature
    unit_s = torch.nn.functional.normalize(shuffled, dim=-1)
    scores = unit_s @ torch.nn.functional.normalize(teacher, dim=-1).t() / SIMILARITY_TEMPERATURE
    expected = float(cosine(shuffled, teacher)) + float(torch.nn.functional.cross_entropy(scores, torch.arange(6)))
    assert float(contrastive(shuffled, teacher)) == pytest.approx(expected, rel=1e-5)
    assert float(contrastive(teacher, teacher)) < float(contrastive(shuffled, teacher))
    one = teacher[:1]  # one text a batch has no structure: the cosine alone
    assert float(relational(one * 2 + 1, one)) == pytest.approx(float(cosine(one * 2 + 1, one)), abs=1e-6)


def test_the_distillation_loss_takes_the_pooled_distance_it_is_given():
    teacher, student = (tuple(torch.cat([a, b]) for a, b in zip(states(2, seed), states(2, seed + 7)))
                        for seed in (0, 1))  # four texts: each has others to be near or far from
    mask = torch.ones(4, 5, dtype=torch.long)
    plain = float(distill_loss(student, teacher, mask))
    assert float(distill_loss(student, teacher, mask, pooled="cosine")) == pytest.approx(plain)
    assert float(distill_loss(student, teacher, mask, pooled="relational")) > plain
    from comera_convert.errors import ConfigError
    from comera_convert.training.options import TrainOptions

    with pytest.raises(ConfigError, match=r"expected a distill_pooled in \('cosine', 'relational', 'contrastive'\)"):
        TrainOptions(distill_pooled="structure")
