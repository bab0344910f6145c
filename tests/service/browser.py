"""Headless Chromium for the tests of the HTTP door's pages (Debian's `chromium` and
`chromium-driver`, driven by selenium). Without them a test skips, except in CI (CI set), where
it fails: .ci/run installs them."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

# Every host name but 127.0.0.1 fails to resolve: a page that reaches for the internet finds nothing.
NO_NETWORK = "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"


@contextlib.contextmanager
def chromium(*extra_args: str) -> Iterator[Any]:
    """A headless Chromium's selenium driver, with `extra_args` on its command line."""
    chromium_path, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        webdriver = None
    missing = [name for name, found in (("chromium", chromium_path), ("chromium-driver", chromedriver),
                                        ("selenium (pip install -e .[test])", webdriver)) if not found]
    if missing:
        message = f"the browser tests need {', '.join(missing)} (apt-get install chromium chromium-driver)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium_path
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1000,1000", "--hide-scrollbars", *extra_args):
        options.add_argument(arg)
    # An explicit driver: selenium's manager would otherwise try to download one.
    browser = webdriver.Chrome(options=options, service=Service(executable_path=chromedriver))
    try:
        yield browser
    finally:
        browser.quit()
