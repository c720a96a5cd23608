import math

import pytest

from comera_convert.tt import TTSpec, clip_ranks, num_params
from comera_convert.tt.counting import dense_params


def test_ranks_are_clipped_to_the_shape():
    spec = TTSpec.plan(768, 3072, 10_000, layout="tt")
    # (12, 8, 8 | 16, 16, 12): bond k holds at most min(prod of left modes, prod of right modes)
    assert spec.ranks == (12, 96, 768, 192, 12)
    assert spec.max_ranks == spec.ranks


def test_clip_respects_neighbouring_bonds():
    assert clip_ranks((2, 100, 100), (4, 8, 8, 4)) == (2, 16, 4)


def test_int_rank_applies_to_every_bond():
    spec = TTSpec.plan(768, 768, 30)
    assert spec.ranks == (12, 30, 30, 30, 8)
    assert spec.core_shapes() == [(1, 12, 12), (12, 8, 30), (30, 8, 30), (30, 12, 30), (30, 8, 8),
                                  (8, 8, 1)]


def test_param_count_is_the_sum_of_core_sizes():
    for layout in ("tt", "ttm"):
        spec = TTSpec.plan(768, 3072, 30, layout=layout)
        assert num_params(spec) == sum(math.prod(s) for s in spec.core_shapes())
        assert num_params(spec) < dense_params(spec) / 10


def test_ttm_core_shapes_pair_modes():
    spec = TTSpec.plan(30522, 768, 30, layout="ttm")
    assert [s[1:3] for s in spec.core_shapes()] == list(zip(spec.row_modes, spec.col_modes))


@pytest.mark.parametrize("bad,message", [
    (dict(rank=0), "rank >= 1"),
    (dict(rank=-3), "rank >= 1"),
    (dict(rank=(4, 4)), "5 positive integer ranks"),
    (dict(rank=2.5), "positive int or a tuple"),
    (dict(rank=8, layout="cp"), "layout in"),
])
def test_bad_arguments_say_what_was_expected(bad, message):
    with pytest.raises(ValueError, match=message):
        TTSpec.plan(768, 768, **bad)


def test_ttm_needs_as_many_row_as_column_modes():
    with pytest.raises(ValueError, match="as many of each"):
        TTSpec.plan(768, 768, 8, layout="ttm", row_modes=(12, 8, 8), col_modes=(32, 24))


def test_dict_round_trip():
    spec = TTSpec.plan(30522, 384, (20, 10), layout="ttm")
    assert TTSpec.from_dict(spec.to_dict()) == spec
