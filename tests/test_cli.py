"""The command line: the demo through ``python -m cpshard``, and one-line usage errors with exit 2."""

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from cpshard.cli import main


@pytest.mark.ranks
def test_python_m_cpshard_demo_runs_and_reports_parity():
    result = subprocess.run(
        [sys.executable, "-m", "cpshard", "demo", "--seq", "64", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "parity" in result.stdout and "PASS" in result.stdout
    assert "all_to_all" in result.stdout and "optimum" in result.stdout


def test_console_script_is_the_cli():
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "cpshard"]
    assert script.value == "cpshard.cli:main"


@pytest.mark.parametrize(
    "argv, says",
    [
        ([], "choose a command"),
        (["bogus"], "invalid choice: 'bogus'"),
        (["demo", "--seq", "ten"], "--seq"),
        (["demo", "--nprocs", "3"], "--nprocs=3 must divide --heads=8"),
        (["demo", "--unknown"], "unrecognized arguments"),
    ],
)
def test_bad_usage_exits_2_with_one_line(capsys, argv, says):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err
