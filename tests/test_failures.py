"""Failures nobody foresaw: one line naming the dependency, its version and the supported range."""

from importlib import metadata

import pytest
import torch
from click.testing import CliRunner

from comera_convert.cli import main
from comera_convert.cli.failures import describe_failure, failing_dependency, supported_ranges


def raised(call):
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the error under test
        return err
    raise AssertionError("expected the call to fail")


def test_the_declared_ranges_are_read_from_the_installed_metadata():
    ranges = supported_ranges()
    assert ranges["transformers"].startswith(">=5.1") and "<6" in ranges["transformers"]
    assert ranges["torch"].startswith(">=")


def test_an_error_inside_a_dependency_names_it_its_version_and_the_range():
    err = raised(lambda: torch.nn.Linear(2, 2).get_parameter("row_of_token"))
    assert failing_dependency(err) == ("torch", "torch.nn.modules.module.get_parameter")
    line = describe_failure(err)
    assert "\n" not in line
    assert line.startswith(f"torch {metadata.version('torch')} failed in torch.nn.modules.module.get_parameter: "
                           f"AttributeError: ")
    assert "row_of_token" in line
    assert f"comera-convert supports torch{supported_ranges()['torch']}" in line
    assert "COMERA_TRACEBACK=1" in line


def test_a_module_a_dependency_lacks_is_blamed_on_that_dependency():
    def import_missing():
        import transformers.no_such_module  # noqa: F401

    err = raised(import_missing)
    assert failing_dependency(err) == ("transformers", "import transformers.no_such_module")


def test_an_error_of_comera_convert_itself_is_an_internal_error():
    from comera_convert.layers.tt_embedding import _check_permutation

    err = raised(lambda: _check_permutation(torch.zeros(3), 3))
    assert failing_dependency(err) is None
    assert describe_failure(err).startswith("internal error in comera-convert: ValueError: expected token_order")


@pytest.fixture
def failing_report(monkeypatch):
    """`comera report` made to fail inside torch, as a moved internal would."""
    import comera_convert.checkpoint_info as info

    monkeypatch.setattr(info, "inspect_checkpoint", lambda *a, **k: torch.nn.Linear(2, 2).get_parameter("gone"))


def test_the_cli_prints_one_line_and_exits_non_zero(failing_report, tmp_path):
    result = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: torch ") and "AttributeError" in lines[0]


def test_comera_traceback_shows_the_whole_error(failing_report, tmp_path):
    result = CliRunner(env={"COMERA_TRACEBACK": "1"}).invoke(main, ["report", str(tmp_path)])
    assert isinstance(result.exception, AttributeError)
