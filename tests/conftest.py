"""Process groups shared by the whole test session: spawning ranks costs seconds, cases cost little.

Functions run on the ranks must live at module level in a test module (workers import them).
"""

import pytest

from cpshard import LocalRanks


@pytest.fixture(scope="session")
def ranks2():
    with LocalRanks(2, timeout=300) as ranks:
        yield ranks


@pytest.fixture(scope="session")
def ranks4():
    with LocalRanks(4, timeout=300) as ranks:
        yield ranks
