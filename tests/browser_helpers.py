"""Headless Chromium for the tests of the pages (the live /kv page, the memory report)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest


def chromium_driver() -> Iterator[object]:
    """A selenium driver on Debian's headless Chromium; skips, saying why, where there is none."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e .[test])")
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip("Debian's chromium and chromium-driver are not installed and could not be here: "
                    "`make setup` installs them with apt-get, which needs root and a Debian-like system")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1366,800",
                "--disable-gpu", "--no-first-run"):
        options.add_argument(arg)
    drv = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield drv
    finally:
        drv.quit()
