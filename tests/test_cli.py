"""The command line: the demo through ``python -m cpshard``, and one-line usage errors with exit 2."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from importlib.metadata import entry_points

import pytest
from procs import children_of, running

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


@pytest.mark.ranks
def test_an_interrupted_command_says_so_in_one_line_and_ends_its_ranks():
    """^C in the middle of a demo's training: exit 130, one line, no traceback, no rank left running."""
    # as a terminal's foreground job starts: SIGINT not ignored. A shell ignores it in the jobs it puts in
    # the background, and a test session started so would pass that on (a caught signal is reset at exec)
    ignored = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        demo = subprocess.Popen(
            [sys.executable, "-m", "cpshard", "demo", "--seq", "256", "--steps", "100000"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # a group of its own, as a terminal's job is: ^C reaches all of it
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},  # SIGABRT prints every thread's stack
        )
    finally:
        signal.signal(signal.SIGINT, ignored)
    for line in demo.stdout:  # until the ranks train
        if "training" in line:
            break
    ranks = children_of(demo.pid)
    os.killpg(demo.pid, signal.SIGINT)  # a terminal's ^C: the launcher and its ranks
    try:
        _, err = demo.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # where the launcher waits, for whoever reads the failure
        os.kill(demo.pid, signal.SIGABRT)
        _, err = demo.communicate(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(demo.pid, signal.SIGKILL)
        pytest.fail(f"the demo did not end within 60 s of ^C; its launcher's threads:\n{err}")
    assert demo.returncode == 130, err
    assert err.strip().splitlines()[-1] == "cpshard demo: interrupted" and "Traceback" not in err, err
    deadline = time.monotonic() + 10  # multiprocessing's resource tracker ends after its launcher
    while any(running(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ranks and not [pid for pid in ranks if running(pid)]


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("cpshard 0.")


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
        # the top level's error named its own help, which lists no option of demo's
        (["demo", "--unknown"], "cpshard demo: error: unrecognized arguments: --unknown (see cpshard demo"),
        (["--unknown"], "cpshard: error: unrecognized arguments: --unknown (see cpshard --help)"),
        (["--unknown", "layout", "llama"], "cpshard: error: unrecognized arguments: --unknown (see cpshard"),
        # it ran, and printed "loss nan nan FAIL"
        (["demo", "--seq", "1"], "--seq=1 leaves no token to predict"),
    ],
)
def test_bad_usage_exits_2_with_one_line(capsys, argv, says):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err
