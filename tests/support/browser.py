"""A real browser for the dashboard tests: Debian's headless Chromium through Selenium."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@contextmanager
def headless_chromium() -> Iterator[Any]:
    """A Selenium driver on Debian's headless Chromium, its browser log kept (callers skip when
    ``CHROMIUM`` or ``CHROMEDRIVER`` is None, or selenium is missing)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--no-first-run", "--disable-quic", "--window-size=1280,1000"):
        options.add_argument(arg)
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        driver.set_page_load_timeout(30)
        yield driver
    finally:
        driver.quit()


def wait_for_js(driver: Any, js: str, timeout: float = 20.0) -> Any:
    """Poll ``js`` in the page until it returns something truthy; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(js)
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {js}")


def browser_errors(driver: Any) -> list[Any]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
