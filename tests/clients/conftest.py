"""The `fake` fixture: a fake GenerateService (tests/clients/fake_service.py) per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.clients.fake_service import FakeGenerateService, start


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeGenerateService, str]]:
    """(the servicer, its address); its `requests` and `metadata` record every call."""
    server, servicer, address = start("fake")
    yield servicer, address
    server.stop(None)
