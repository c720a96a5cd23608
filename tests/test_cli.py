from click.testing import CliRunner

import comera_convert
from comera_convert.cli import main


def test_version():
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert comera_convert.__version__ in result.output


def test_help_lists_the_commands():
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    assert "Tensor-train compression" in result.output
