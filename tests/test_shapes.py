import math

import pytest

from comera_convert.errors import ShapeError
from comera_convert.tt.shapes import MAX_IMBALANCE, check_modes, plan_modes

# Real dimensions of BERT, GPT-2, Llama and MiniLM (hidden, FFN, vocab sizes).
REAL_SIZES = [768, 3072, 1024, 4096, 11008, 30522, 50257, 32000, 384, 1536]


@pytest.mark.parametrize("n", REAL_SIZES)
@pytest.mark.parametrize("d", [2, 3, 4])
def test_real_sizes_factor_balanced_with_little_padding(n, d):
    modes = plan_modes(n, d)
    assert len(modes) == d
    assert math.prod(modes) >= n
    assert math.prod(modes) / n - 1 < 0.005  # padding stays under half a percent
    assert max(modes) / min(modes) <= MAX_IMBALANCE
    assert list(modes) == sorted(modes, reverse=True)


def test_exact_sizes_are_not_padded():
    assert plan_modes(768, 3) == (12, 8, 8)
    assert plan_modes(4096, 3) == (16, 16, 16)
    assert math.prod(plan_modes(3072, 3)) == 3072


def test_badly_factoring_vocab_is_padded():
    modes = plan_modes(30522, 3)
    assert math.prod(modes) > 30522  # 30522 = 2 * 3 * 5087 has no balanced factorization


@pytest.mark.parametrize("n,d", [(0, 3), (-5, 2), (7, 3), (768, 9)])
def test_bad_dimensions_are_refused(n, d):
    with pytest.raises(ShapeError, match="expected|too small"):
        plan_modes(n, d)


def test_modes_that_do_not_cover_the_size_are_refused():
    with pytest.raises(ShapeError, match=r"multiply to 512, expected at least 768"):
        check_modes((8, 8, 8), 768, "row modes")
    with pytest.raises(ShapeError, match="positive integers"):
        check_modes((8, 0, 12), 768, "row modes")
