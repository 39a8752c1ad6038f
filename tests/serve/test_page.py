"""The page at ``/`` in a real browser: Debian's chromium driven by selenium (chromium-driver).

Type and speak (the audio plays as it streams and its length is known: greedy runs of the tiny model yield
exactly N frames), add a voice and see it listed, and see the server's message for a bad request. Without
a browser these tests skip naming the install; in CI (which installs it, .ci/run) they fail instead.
Set MOSS_NPU_PAGE_SCREENSHOT=FILE.png to keep a screenshot of the page after speaking (docs/page.png).
"""

from __future__ import annotations

import os
import shutil

import pytest

from moss_npu_verify import goldens
from tests.optional import missing, require
from tests.serve.conftest import serve_module

serve_module("fastapi")
webdriver = require("selenium.webdriver", "pip install -e '.[dev]'")
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if not (CHROMIUM and DRIVER):
    missing("chromium and chromedriver are not installed; install them with "
            "`apt-get install -y chromium chromium-driver`")

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support import expected_conditions as ready  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

FRAMES = 6
WAIT_S = 120


@pytest.fixture(scope="module")
def keyless(keyless_server):
    """A server without an API key: the page needs none and shows no key field."""
    return keyless_server


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1000,900",
                 "--autoplay-policy=no-user-gesture-required"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=DRIVER), options=options)
    yield driver
    driver.quit()


def open_page(browser, server) -> None:
    browser.get(server.url + "/")
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-ready"))


def fill(browser, element_id: str, text: str) -> None:
    field = browser.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(text)


def short_greedy_run(browser) -> None:
    browser.find_element(By.CSS_SELECTOR, "details summary").click()  # "More settings"
    fill(browser, "max-frames", str(FRAMES))
    if not browser.find_element(By.ID, "greedy").is_selected():
        browser.find_element(By.ID, "greedy").click()


def error_text(browser) -> str:
    WebDriverWait(browser, WAIT_S).until(ready.visibility_of_element_located((By.ID, "error")))
    return browser.find_element(By.ID, "error").text


def test_type_speak_and_the_audio_plays(browser, keyless):
    open_page(browser, keyless)
    assert not browser.find_element(By.ID, "key-row").is_displayed()  # a keyless server asks for no key
    fill(browser, "text", "Hello from the browser.")
    short_greedy_run(browser)
    browser.find_element(By.ID, "speak").click()
    WebDriverWait(browser, WAIT_S).until(ready.visibility_of_element_located((By.ID, "result")))
    seconds = float(browser.find_element(By.ID, "result").get_attribute("data-seconds"))
    assert seconds == pytest.approx(FRAMES * 0.08, abs=1e-3)
    duration = browser.execute_async_script("""
        const done = arguments[arguments.length - 1], player = document.getElementById("player");
        if (player.readyState >= 1) done(player.duration);
        else player.addEventListener("loadedmetadata", () => done(player.duration));""")
    assert duration == pytest.approx(seconds, abs=0.01)
    assert "first sound after" in browser.find_element(By.ID, "status").text
    assert browser.find_elements(By.CSS_SELECTOR, "#timestamps li")  # the chunk's times are listed
    assert browser.find_element(By.ID, "download").get_attribute("href").startswith("blob:")
    if os.environ.get("MOSS_NPU_PAGE_SCREENSHOT"):
        browser.save_screenshot(os.environ["MOSS_NPU_PAGE_SCREENSHOT"])


def test_upload_a_voice_and_see_it_listed(browser, keyless):
    open_page(browser, keyless)
    browser.find_element(By.CSS_SELECTOR, "#upload-box summary").click()
    fill(browser, "voice-name", "browser voice")
    reference = goldens.fixtures_root() / "nano-tiny" / "goldens" / "reference.wav"
    browser.find_element(By.ID, "voice-file").send_keys(str(reference))
    browser.find_element(By.ID, "upload-button").click()
    WebDriverWait(browser, WAIT_S).until(
        lambda d: "browser voice" in [o.text for o in d.find_elements(By.CSS_SELECTOR, "#voice option")])
    assert browser.find_element(By.ID, "upload-status").text == "added browser voice"


def test_a_bad_request_shows_the_server_message(browser, keyless):
    open_page(browser, keyless)
    fill(browser, "speed", "9")
    browser.find_element(By.ID, "speak").click()
    assert "speed 9.0: out of range; use 0.25 .. 4.0" in error_text(browser)


def test_a_keyed_server_asks_for_the_key(browser, server):
    open_page(browser, server)
    assert browser.find_element(By.ID, "key-row").is_displayed()
    browser.find_element(By.ID, "speak").click()
    assert "invalid or missing API key" in error_text(browser)
    fill(browser, "api-key", server.api_key)
    short_greedy_run(browser)
    browser.find_element(By.ID, "speak").click()
    WebDriverWait(browser, WAIT_S).until(ready.visibility_of_element_located((By.ID, "result")))
    assert not browser.find_element(By.ID, "error").is_displayed()
