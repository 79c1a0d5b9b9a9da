"""A headless Chromium for the dashboard tests: Debian's ``chromium`` and ``chromium-driver``
driven by Selenium, with nothing downloaded at run time.

Missing pieces FAIL the test with the reason (``make test`` installs them): a dashboard test
that skipped silently would let a broken page ship.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest

CHROMIUM = os.environ.get("KVROUTE_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("KVROUTE_CHROMEDRIVER", "/usr/bin/chromedriver")
INSTALL_HINT = "run `make install` (as root it runs `apt-get install -y chromium chromium-driver`)"


def chromium() -> Any:
    """A started headless Chromium WebDriver (the caller quits it)."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not (os.path.exists(p) or shutil.which(p))]
    if missing:
        pytest.fail(f"the dashboard tests need {', '.join(missing)}: {INSTALL_HINT}")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError as exc:
        pytest.fail(f"the dashboard tests need selenium ({exc}): {INSTALL_HINT}")
    options = Options()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",  # root in a container
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1500,1250",
        "--force-device-scale-factor=1",
        "--no-first-run",
        "--disable-extensions",
    ):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def text_of(driver: Any, css: str) -> str:
    from selenium.webdriver.common.by import By

    return str(driver.find_element(By.CSS_SELECTOR, css).text)


def wait_for(driver: Any, predicate: Any, timeout_s: float = 15.0, what: str = "") -> Any:
    """Until ``predicate(driver)`` is truthy; fails with ``what`` and the page's status."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout_s, poll_frequency=0.2).until(predicate)
    except TimeoutException:
        status = driver.execute_script(
            "const s = document.getElementById('status'); return s ? s.textContent : null;"
        )
        logs = []
        try:
            logs = [e.get("message") for e in driver.get_log("browser")]
        except Exception:
            pass
        pytest.fail(f"timed out waiting for {what or predicate}; page status {status!r}; {logs}")
