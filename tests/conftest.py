"""Process groups shared by the whole test session: spawning ranks costs seconds, cases cost little.

Functions run on the ranks must live at module level in a test module (workers import them). A test that
starts ranks (through these fixtures, or processes of its own, marked by hand) carries the ``ranks``
marker: ``python -m pytest -q -m "not ranks" tests`` runs the rest alone, in seconds.
"""

import pytest

from cpshard import LocalRanks


def pytest_collection_modifyitems(items):
    for item in items:
        if {"ranks2", "ranks4"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.ranks)


@pytest.fixture(scope="session")
def ranks2():
    with LocalRanks(2, timeout=300) as ranks:
        yield ranks


@pytest.fixture(scope="session")
def ranks4():
    with LocalRanks(4, timeout=300) as ranks:
        yield ranks
