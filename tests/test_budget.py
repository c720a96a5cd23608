"""The late stage's budget: its schedule, and which entries close to meet it."""

import pytest

from comera_convert.training.budget import ModuleBonds, bond_floor, choose_closures, closable, scheduled_size


def test_schedule_starts_at_the_switch_size_ends_at_the_target_and_never_rises():
    sizes = [scheduled_size(1000, 400, step / 10) for step in range(-2, 13)]
    assert sizes[0] == sizes[2] == 1000 and sizes[-1] == sizes[12] == 400
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))
    # Cubic: most of the way in the first half, the last closures spread out.
    assert scheduled_size(1000, 400, 0.5) == 400 + round(600 / 8)


@pytest.mark.parametrize("open_count,multiple,count", [
    (10, 1, 1), (1, 1, 0), (12, 8, 4), (16, 8, 8), (8, 8, 0), (5, 8, 0), (9, 4, 1)])
def test_units_close_to_the_next_multiple_and_never_empty_a_bond(open_count, multiple, count):
    assert closable(open_count, multiple) == count


@pytest.mark.parametrize("start,multiple,floor", [(100, 1, 25), (10, 1, 3), (2, 1, 1), (1, 1, 1),
                                                  (64, 8, 16), (20, 8, 8), (12, 8, 8), (5, 8, 5)])
def test_a_bond_keeps_a_quarter_of_its_starting_rank_in_whole_multiples(start, multiple, floor):
    assert bond_floor(start, multiple) == floor
    assert closable(floor, multiple, floor) == 0
    if start > floor:
        assert closable(floor + multiple, multiple, floor) == multiple


def _module(importance, physical=(4, 4, 4)):
    """Bonds with the given importances per open entry; entry ids are their positions."""
    ordered = [sorted(range(len(scores)), key=lambda i: scores[i]) for scores in importance]
    return ModuleBonds(list(physical), [list(o) for o in ordered],
                       [[scores[i] for i in o] for scores, o in zip(importance, ordered)])


def test_the_least_important_entries_per_parameter_freed_close_first():
    a = _module([[0.5, 0.01, 0.9], [0.2, 0.3]])
    b = _module([[0.02, 0.8]], physical=(100, 100))  # an entry here frees far more per closure
    # Ranks a: (3, 2) -> one entry of a's bond 0 frees 4*1 + 4*2 + 1 = 13; b's frees 100 + 100 + 1 = 201.
    freed = choose_closures([a, b], excess=201)
    # b's 0.02 over 201 (1e-4) beats a's 0.01 over 13 (8e-4): b closes first and covers the excess.
    assert b.closing == {0: [0]} and a.closing == {} and freed == 201
    freed = choose_closures([a], excess=13)
    assert a.closing == {0: [1]} and freed == 13


def test_a_unit_larger_than_what_is_left_to_free_waits_for_the_ones_that_fit():
    a = _module([[0.5, 0.01, 0.9], [0.2, 0.3]])
    b = _module([[0.02, 0.8]], physical=(100, 100))
    # 20 left to free: b's unit (201) would overshoot tenfold; a's weakest (13) fits, then the
    # smallest unit left covers the remaining 7 (a's bond 1 at ranks (2, 2): 4*2 + 4 + 1 = 13).
    assert choose_closures([a, b], excess=20) == 26
    assert b.closing == {} and a.closing == {0: [1], 1: [0]}


def test_closures_stop_at_every_bonds_floor_and_keep_multiples():
    module = _module([[0.1 * i for i in range(12)]])
    assert choose_closures([module], excess=10 ** 9, multiple=4) < 10 ** 9  # floors reached first
    assert sorted(module.closing[0]) == list(range(8)) and len(module.open[0]) == 4  # 12 -> 8 -> 4
    single = _module([[0.3, 0.2, 0.1]])
    choose_closures([single], excess=10 ** 9)
    assert single.open == [[0]]  # the most important entry is the last one left
    floored = _module([[0.1 * i for i in range(12)], [0.5, 0.6]])
    floored.floors = [3, 2]
    choose_closures([floored], excess=10 ** 9)
    assert sorted(floored.open[0]) == [9, 10, 11] and floored.closing.get(1) is None
