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
