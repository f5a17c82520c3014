"""Headless Chromium for browser tests (Selenium with the system chromium and chromedriver).

``CHROMIUM`` and ``CHROMEDRIVER`` override the binaries (defaults ``/usr/bin/chromium`` and
``/usr/bin/chromedriver``). Tests call :func:`chromium_available` first and skip with its
reason, then use :func:`headless_chromium`, which always ends the browser it started.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger: logging.Logger = logging.getLogger(__name__)

DEFAULT_CHROMIUM = "/usr/bin/chromium"
DEFAULT_CHROMEDRIVER = "/usr/bin/chromedriver"
WINDOW_SIZE = (1280, 800)
PAGE_LOAD_TIMEOUT_S = 30


def chromium_path() -> str:
    """The chromium binary: ``$CHROMIUM`` or ``/usr/bin/chromium``."""
    return os.environ.get("CHROMIUM") or DEFAULT_CHROMIUM


def chromedriver_path() -> str:
    """The chromedriver binary: ``$CHROMEDRIVER`` or ``/usr/bin/chromedriver``."""
    return os.environ.get("CHROMEDRIVER") or DEFAULT_CHROMEDRIVER


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def chromium_available() -> str | None:
    """Why browser tests cannot run here, or ``None`` when they can.

    Returns:
        A reason for ``pytest.skip`` when selenium, chromium or chromedriver is missing.
    """
    if importlib.util.find_spec("selenium") is None:
        return "selenium is not installed"
    browser = chromium_path()
    if not _executable(browser):
        return f"chromium not found at {browser} (set CHROMIUM)"
    driver = chromedriver_path()
    if not _executable(driver):
        return f"chromedriver not found at {driver} (set CHROMEDRIVER)"
    return None


def _pids_using(marker: str) -> list[int]:
    """Pids of processes whose command line mentions ``marker`` (Linux ``/proc`` only)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    own = os.getpid()
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == own:
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline:
            found.append(int(entry.name))
    return found


def _kill_leftovers(user_data_dir: str, grace_s: float = 5.0) -> None:
    """Waits up to ``grace_s`` for browser processes on our private profile directory to
    exit, then SIGKILLs those still running.

    The directory is unique to one :func:`headless_chromium` call, so this only ever
    reaches processes that call started.
    """
    deadline = time.monotonic() + grace_s
    while _pids_using(user_data_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in _pids_using(user_data_dir):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            logger.warning("killed leftover browser process %d", pid)


@contextlib.contextmanager
def headless_chromium() -> Iterator[Any]:
    """Starts headless Chromium through chromedriver and yields the Selenium WebDriver.

    The browser runs with a fresh temporary profile, a 1280x800 window, a 30 s page-load
    timeout and console logging enabled (see :func:`console_errors`), and its own temporary
    directory (``TMPDIR``: the shared-memory files ``--disable-dev-shm-usage`` puts there,
    which a killed browser leaves behind). On exit (also when the test fails) the driver
    quits, chromedriver stops, any browser process left on the profile is killed and the
    profile and that directory are removed.

    Yields:
        A ``selenium.webdriver.Chrome``.
    """
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    root = tempfile.mkdtemp(prefix="torchft-chromium-")
    user_data_dir, tmp_dir = os.path.join(root, "profile"), os.path.join(root, "tmp")
    os.mkdir(user_data_dir)
    os.mkdir(tmp_dir)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium_path()
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--password-store=basic",
        f"--user-data-dir={user_data_dir}",
        f"--window-size={WINDOW_SIZE[0]},{WINDOW_SIZE[1]}",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(
        executable_path=chromedriver_path(),
        log_output=subprocess.DEVNULL,
        env={**os.environ, "TMPDIR": tmp_dir},
    )

    driver = None
    try:
        driver = webdriver.Chrome(service=service, options=options)
        driver.set_page_load_timeout(PAGE_LOAD_TIMEOUT_S)
        driver.set_window_size(*WINDOW_SIZE)
        yield driver
    finally:
        if driver is not None:
            try:
                driver.quit()
            except Exception:  # cleanup must go on
                logger.exception("driver.quit() failed")
        with contextlib.suppress(Exception):
            service.stop()
        _kill_leftovers(user_data_dir)
        shutil.rmtree(root, ignore_errors=True)


def console_entries(driver: Any) -> list[dict[str, Any]]:
    """Drains the browser console log collected since the last call.

    Returns:
        Entries as given by chromedriver (``level``, ``message``, ``source``, ``timestamp``).
    """
    return list(driver.get_log("browser"))


def console_errors(driver: Any, level: str = "SEVERE") -> list[dict[str, Any]]:
    """Console entries at ``level`` (default ``SEVERE``: errors, uncaught exceptions,
    failed requests) since the last drain.

    Returns:
        The matching entries; tests assert this is empty.
    """
    return [e for e in console_entries(driver) if e.get("level") == level]
