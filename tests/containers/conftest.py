"""Container tests: `make test-containers` runs them (`-m containers`); `make test` leaves them out."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    # the test's outcome on its node, for the fixture that prints the containers' logs on failure
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep
