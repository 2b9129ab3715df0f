"""``cpshard bench --packed``: each order's ring tiles on packed rows counted, each rank's compute timed."""

import pytest

from cpshard.bench.packed import ORDERS, packed_report
from cpshard.cli import main


def test_striped_order_balances_the_issue_rows_and_every_order_is_timed():
    lines = []
    result = packed_report([256], [2], 1, 1, out=lines.append)
    counted = result["counted"]
    assert counted["striped"][0] <= 1.05 < counted["head_tail"][0] < counted["contiguous"][0], counted
    assert all(
        extra == 1.0 for _, _, extra in counted.values()
    )  # no order computes more tiles than one process
    assert sorted(order for _, _, order in result["timed"]) == sorted(ORDERS)
    assert all(seconds > 0 and balance >= 1 for seconds, balance in result["timed"].values())
    assert sum(line.startswith("| striped |") for line in lines) == 1


@pytest.mark.ranks  # starts its own ranks
def test_the_command_line_prints_both_tables(capsys):
    assert main(["bench", "--packed", "1", "--seqs", "256", "--cp", "2", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "tiles per rank on packed 131,072-token rows, cp=8" in out
    assert "| 2 | 256 | striped |" in out
