"""The console in a real browser: headless Chromium and its chromedriver from the OS's packages
(.ci/run installs them), driven by Selenium with both paths given, so nothing is downloaded.
The operator sees a dead letter and a stuck claim, redrives the one and resolves the other;
the ledger and claim_history say so. Screenshots are kept in the test's tmp dir
(CONSOLE_SCREENSHOT=PATH also writes the overview's there, for the docs)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from consolekit import console, seed
from drainkit import OPERATOR, Harness
from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.wait import WebDriverWait

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    for path in (CHROMIUM, CHROMEDRIVER):
        if shutil.which(path) is None:
            pytest.fail(f"{path} is missing: apt-get install chromium chromium-driver (.ci/run)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    options.add_argument("--window-size=1280,1000")
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()


def goes_to(browser: webdriver.Chrome, element: WebElement, text: str) -> None:
    """Click, then wait (20 s at most) for the page the click led to, loaded and holding `text`.

    Every page the console renders carries a mark of its own (`data-render` on `<html>`), so the
    next page is the one whose mark differs from the current one's: a text that the old page
    holds too (the preview shows the redrive's command line, as the result page does) cannot
    match early. Each check reads the document through one script, never through a node found
    before: a node of the page being replaced may be gone when it is asked about (Chrome's "Node
    with given id does not belong to the document"), which means the next page is not there yet."""
    before = page_state(browser)[0]
    element.click()

    def arrived(driver: webdriver.Chrome) -> bool:
        try:
            mark, ready, html = page_state(driver)
        except WebDriverException:
            return False
        return mark != before and ready == "complete" and text in html

    WebDriverWait(browser, 20).until(arrived, f"no page holding {text!r} followed the click")


def page_state(driver: webdriver.Chrome) -> tuple[str, str, str]:
    """The current document's render mark, its readyState and its HTML, read at once."""
    state = driver.execute_script(
        "const html = document.documentElement;"
        "return [html.dataset.render || '', document.readyState, html.outerHTML];"
    )
    mark, ready, html = state
    return str(mark), str(ready), str(html)


def test_the_operator_redrives_a_dead_letter_and_resolves_a_stuck_claim(
    kit: Harness, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    # Given dead letters, a stuck claim and deferred work, and a console that may act
    seeded = seed(kit)
    letter = seeded.dead_letter_ids[0]
    with console(kit, "--allow-actions") as running:
        # When the operator opens the printed URL
        browser.get(running.url)
        # Then the overview counts them, and the token has left the address bar
        assert "token=" not in browser.current_url
        assert browser.find_element(By.ID, "count-dead-letters").text.startswith("2")
        assert browser.find_element(By.ID, "count-stuck").text.startswith("1")
        browser.save_screenshot(str(tmp_path / "overview.png"))
        if os.environ.get("CONSOLE_SCREENSHOT"):
            browser.save_screenshot(os.environ["CONSOLE_SCREENSHOT"])

        # When they select one dead letter, preview its redrive, and redrive it
        goes_to(
            browser, browser.find_element(By.LINK_TEXT, "Dead letters"), 'tr class="dead-letter"'
        )
        rows = browser.find_elements(By.CSS_SELECTOR, "tr.dead-letter")
        assert len(rows) == 2
        browser.find_element(By.CSS_SELECTOR, f'input[name="m"][value="{letter}"]').click()
        goes_to(browser, browser.find_element(By.ID, "preview"), "Redrive preview")
        would_run = browser.find_elements(By.CSS_SELECTOR, "tr.would-run")
        assert [row.text.split()[0] for row in would_run] == [letter]
        goes_to(browser, browser.find_element(By.ID, "redrive"), "infrai-jobs redrive")

        # And they resolve the stuck claim as done, with the provider's id
        goes_to(
            browser, browser.find_element(By.LINK_TEXT, "Stuck claims"), 'tr class="stuck-claim"'
        )
        (stuck_row,) = browser.find_elements(By.CSS_SELECTOR, "tr.stuck-claim")
        assert seeded.stuck_key in stuck_row.text
        browser.save_screenshot(str(tmp_path / "stuck.png"))
        stuck_row.find_element(By.XPATH, ".//summary[text()='Resolve done']").click()
        stuck_row.find_element(By.NAME, "result").send_keys('{"mail_id": "m-42"}')
        button = stuck_row.find_element(By.CSS_SELECTOR, "button.resolve-done")
        goes_to(browser, button, "infrai-jobs claims resolve")
        browser.save_screenshot(str(tmp_path / "resolved.png"))

    # Then the ledger has the one letter redriven and the other unresolved
    rows = kit.sql("SELECT message_id, resolution, resolved_by FROM dead_letters")
    assert sorted(rows) == sorted(
        [(letter, "redriven", OPERATOR), (seeded.dead_letter_ids[1], None, None)]
    )
    # And the claim is done with the result given, recorded in claim_history as the operator
    row = kit.row(seeded.stuck_key)
    assert row is not None
    assert (row.state, row.result) == ("done", {"mail_id": "m-42"})
    assert [(a, actor) for a, actor, _ in kit.history(seeded.stuck_key)] == [
        ("resolve_done", OPERATOR)
    ]
    assert (tmp_path / "overview.png").stat().st_size > 10_000
