"""Long variants: tests marked ``long`` repeat what a shorter test already covers under another timing or order.
They run by hand with ``LIGHTNING_EMIG_LONG_TESTS=1`` and are skipped in ``make test`` (kept under 20 minutes on
2 cores)."""

from __future__ import annotations

import os

import pytest

LONG_TESTS = os.environ.get("LIGHTNING_EMIG_LONG_TESTS") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if LONG_TESTS:
        return
    skip = pytest.mark.skip(reason="a long variant: set LIGHTNING_EMIG_LONG_TESTS=1")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)
