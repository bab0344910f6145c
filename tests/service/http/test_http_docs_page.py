"""The HTTP door's API page, /docs (Swagger UI), in headless Chromium with no network (every host
name but 127.0.0.1 unresolvable): it renders every operation of the app's schema, and every
script, style sheet and image it loads comes from the server itself (the fastapi-offline
package's copies), none from a CDN."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from pie.engine.config import EngineConfig
from pie.service.server import BackgroundServer, ServerConfig
from tests.service.browser import NO_NETWORK, chromium

# slow: a server and a browser
pytestmark = pytest.mark.slow

WAIT_S = 60


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with BackgroundServer(ServerConfig(port=0, http_port=0, grace_s=2), EngineConfig(device="cpu", num_kv_blocks=64)) as s:
        assert s.http_url is not None
        yield s.http_url


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    with chromium(NO_NETWORK) as browser:
        yield browser


def operations(base: str) -> list[tuple[str, str]]:
    """(METHOD, path) of every operation of the app's OpenAPI schema."""
    with urllib.request.urlopen(base + "/openapi.json", timeout=WAIT_S) as r:
        schema = json.load(r)
    return sorted((method.upper(), path) for path, item in schema["paths"].items() for method in item)


def loaded_from(driver) -> list[str]:
    """The URLs of everything the page loaded besides itself (scripts, styles, images, fetches)."""
    return driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")


def test_swagger_ui_renders_every_operation_without_network(driver, base):
    from selenium.webdriver.support.ui import WebDriverWait  # the driver fixture skips without selenium

    expected = operations(base)
    assert ("POST", "/v1/chat/completions") in expected and ("GET", "/v1/models") in expected
    driver.get(base + "/docs")
    shown = WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(
        lambda d: d.execute_script(
            "const ops = [...document.querySelectorAll('.opblock-summary')].map(o => [o.querySelector("
            "'.opblock-summary-method').textContent, o.querySelector('.opblock-summary-path').dataset.path]);"
            "return ops.length ? ops : null"),
        message="Swagger UI's operations")
    assert sorted(map(tuple, shown)) == expected
    urls = loaded_from(driver)
    assert any(u.endswith("/swagger-ui-bundle.js") for u in urls) and any(u.endswith("/openapi.json") for u in urls)
    assert all(u.startswith(base + "/") for u in urls), urls


def test_no_redoc_page(base):
    """ReDoc's bundle fetches its logo from a CDN: the app has no /redoc."""
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(base + "/redoc", timeout=WAIT_S)
    assert error.value.code == 404
