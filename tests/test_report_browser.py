"""report.html in a real browser: Debian's headless Chromium (installed by `make setup`)
opens the report of a real (short) run, the plots and the trajectory viewer render with no
console error, a click opens a trajectory with its sampled and masked tokens, the filters
work, and a screenshot is saved."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import SMALL_RUN
from turnrl.report import write_report
from turnrl.trainer.config import load_config
from turnrl.trainer.loop import train

CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def browser_missing() -> str | None:
    missing = [p for p in (CHROMIUM, DRIVER) if not Path(p).exists()]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package")
    return ", ".join(missing) or None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    missing = browser_missing()
    if missing:
        if os.environ.get("CI"):  # `make setup` installs them: in CI their absence is a bug
            pytest.fail(f"CI lacks {missing}; `make setup` should have installed it")
        pytest.skip(f"no headless browser here ({missing} missing); run `make setup`")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="turnrl-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--window-size=1400,1000",
    ):
        options.add_argument(flag)  # fmt: skip
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("run") / "run"
    train(load_config("quickstart", [*SMALL_RUN, "steps=3"]), run_dir, progress=False)
    return write_report(run_dir)


def test_the_report_renders_and_a_trajectory_opens(
    browser: Any, report: Path, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    html = report.read_text()
    assert "http://" not in html
    assert "https://" not in html  # self-contained: nothing fetched
    browser.get(report.as_uri())
    charts = browser.find_elements(By.CSS_SELECTOR, "#curves svg.chart")
    titles = {c.get_attribute("aria-label") for c in charts}
    assert {"success", "reward", "entropy", "gradient norm", "tool use"} <= titles
    assert all(c.find_elements(By.CSS_SELECTOR, "polyline, circle") for c in charts)
    rows = browser.find_elements(By.CSS_SELECTOR, "#episode-list tr[data-task]")
    assert rows, "the viewer lists no episode"
    rows[0].click()
    episode = browser.find_element(By.ID, "episode")
    assert episode.text.startswith("step ")
    assert "reward" in episode.text
    sampled = episode.find_elements(By.CSS_SELECTOR, ".tok.sampled")
    masked = episode.find_elements(By.CSS_SELECTOR, ".tok.masked")
    assert sampled
    assert masked
    assert sampled[0].value_of_css_property("background-color") != masked[0].value_of_css_property(
        "background-color"
    )  # sampled and masked tokens look different
    assert sampled[0].get_attribute("title").startswith("log-prob ")
    browser.find_element(By.ID, "f-reward").send_keys("99")  # no episode earns that much
    assert not browser.find_elements(By.CSS_SELECTOR, "#episode-list tr[data-task]")
    assert browser.find_element(By.ID, "f-count").text == f"0 of {len(rows)} episodes"
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []
    shot = tmp_path / "report.png"
    assert browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000
