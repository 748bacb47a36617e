"""The live page in a real browser: Debian's chromium, headless, driven by selenium through chromedriver,
against a real `sluice serve` on the bundled model. It sends a prompt, waits for the streamed tokens,
checks each token span's probability and entropy against the engine's own logprobs, hovers one for its
alternatives, and reads the valve panel's per-layer values against `sluice.observe` run here on the
same text. Skipped only where no chromium + chromedriver is installed (.ci/run installs them).

SLUICE_SCREENSHOT_DIR=dir: also save the page as dir/live-page.png (docs/img/live-page.png is made so).
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import sluice
from server_harness import serve_process

webdriver = pytest.importorskip("selenium.webdriver")
CHROMIUM = next((p for p in (shutil.which("chromium"), "/usr/bin/chromium") if p and os.path.exists(p)), None)
CHROMEDRIVER = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if os.path.exists("/usr/bin/chromedriver") else None)
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip("no chromium + chromedriver installed (apt-get install chromium chromium-driver)", allow_module_level=True)

from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.select import Select  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT, MAX_TOKENS, TOP = "def read_config(path):", 24, 5
# The flags the project runs chromium with: no sandbox (root in a container), no GPU, and nothing that
# reaches for the network on its own (updates, sync, QUIC probes).
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,1000"]
TIMEOUT_S = 120  # hang-stoppers, 10x+ what each wait takes here under load


@pytest.fixture(scope="module")
def server():
    proc, port = serve_process(timeout=TIMEOUT_S)  # the bundled model
    try:
        yield port
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    driver.set_page_load_timeout(TIMEOUT_S)
    yield driver
    driver.quit()


def _set(driver, element_id: str, value: str) -> None:
    box = driver.find_element(By.ID, element_id)
    box.clear()
    box.send_keys(value)


def test_the_page_streams_tokens_with_probabilities_and_draws_the_valves(server, browser):
    wait = WebDriverWait(browser, TIMEOUT_S)
    browser.get(f"http://127.0.0.1:{server}/")  # redirected to /live/
    wait.until(lambda d: d.find_element(By.ID, "model").text == "sluice-stdlib")
    assert browser.find_element(By.ID, "mode").get_attribute("value") == "completion"  # the bundled model's default
    _set(browser, "temperature", "0")
    _set(browser, "max-tokens", str(MAX_TOKENS))
    _set(browser, "input", PROMPT)
    browser.execute_script("""window.seen = [];  // every context size the valve panel shows, in order
        new MutationObserver(() => window.seen.push(Number(document.body.dataset.valvesTokens)))
            .observe(document.body, {attributes: true, attributeFilter: ["data-valves-tokens"]});""")
    browser.find_element(By.ID, "send").click()
    wait.until(lambda d: "finished" in d.find_element(By.ID, "status").text)

    # the tokens: the engine's greedy continuation, each span with its probability and entropy
    llm = sluice.LLM()
    ref = llm.generate([PROMPT], sluice.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=TOP))[0]
    spans = browser.find_elements(By.CSS_SELECTOR, ".tok")
    assert [s.get_attribute("textContent") for s in spans] == [t.token for t in ref.logprobs]
    np.testing.assert_allclose([float(s.get_attribute("data-p")) for s in spans],
                               [math.exp(t.logprob) for t in ref.logprobs], rtol=1e-4)
    np.testing.assert_allclose([float(s.get_attribute("data-entropy")) for s in spans],
                               [t.entropy for t in ref.logprobs], atol=1e-4)
    colours = {s.value_of_css_property("background-color") for s in spans}
    assert len(colours) > 3  # coloured by probability, not one colour for all

    # hovering a token shows its alternatives, best first, the chosen one marked
    i = 2
    ActionChains(browser).move_to_element(spans[i]).perform()
    tip = browser.find_element(By.ID, "tip")
    wait.until(lambda d: tip.is_displayed())
    rows = tip.find_elements(By.CSS_SELECTOR, "tr")
    shown = [r.find_element(By.CSS_SELECTOR, "td.alt").text for r in rows]
    visible = lambda s: s.replace("\n", "↵").replace("\t", "⇥").replace(" ", "·")  # noqa: E731 -- as live.js shows them
    assert shown[:TOP] == [visible(a.token) for a in ref.logprobs[i].top]
    assert "entropy" in tip.text and len(tip.find_elements(By.CSS_SELECTOR, "tr.chosen")) == 1

    # the valve panel: the context as it stands at the end, measured as sluice.observe measures it
    text = "".join(t.token for t in ref.logprobs)
    ids = llm.tokenizer.encode(PROMPT) + llm.tokenizer.encode(text, add_special_tokens=False)
    wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-valves-tokens") == str(len(ids)))
    seen = browser.execute_script("return window.seen")  # the panel followed the text: prompt first, then growing
    assert seen[0] == len(llm.tokenizer.encode(PROMPT)) and seen[-1] == len(ids) and seen == sorted(seen), seen
    with sluice.observe(llm.model, attention=False) as obs, torch.inference_mode():
        llm.model(torch.tensor([ids]))
    residual = browser.find_elements(By.CSS_SELECTOR, 'figure[data-valve="residual"] rect[data-value]')
    np.testing.assert_allclose([float(r.get_attribute("data-value")) for r in residual],
                               obs.summary()["residual_rms"], rtol=1e-4)
    gains = browser.find_elements(By.CSS_SELECTOR, 'figure[data-valve="gains"] rect[data-value]')
    assert [g.get_attribute("data-name") for g in gains] == obs.norm_names
    np.testing.assert_allclose([float(g.get_attribute("data-value")) for g in gains],
                               obs.norm_gain()[:, 0].mean(-1), rtol=1e-4)
    assert browser.find_elements(By.CSS_SELECTOR, 'figure[data-valve="logits"] polygon')
    table = browser.find_element(By.CSS_SELECTOR, 'figure[data-valve="softmax"] table').text
    assert all(d in table for d in ("float32", "float16", "bfloat16"))
    assert not browser.find_element(By.ID, "valves-status").is_displayed()  # no error shown

    if os.environ.get("SLUICE_SCREENSHOT_DIR"):
        out = Path(os.environ["SLUICE_SCREENSHOT_DIR"])
        out.mkdir(parents=True, exist_ok=True)
        _set(browser, "max-tokens", "40")
        browser.find_element(By.ID, "send").click()  # an empty prompt continues the text
        wait.until(lambda d: "finished" in d.find_element(By.ID, "status").text)
        wait.until(lambda d: int(d.find_element(By.TAG_NAME, "body").get_attribute("data-valves-tokens")) > len(ids))
        ActionChains(browser).move_to_element(browser.find_elements(By.CSS_SELECTOR, ".tok")[-6]).perform()
        browser.save_screenshot(str(out / "live-page.png"))


def test_chat_mode_renders_the_template_and_measures_the_same_context(server, browser):
    wait = WebDriverWait(browser, TIMEOUT_S)
    browser.get(f"http://127.0.0.1:{server}/live/")
    wait.until(lambda d: d.find_element(By.ID, "model").text == "sluice-stdlib")
    Select(browser.find_element(By.ID, "mode")).select_by_value("chat")
    _set(browser, "temperature", "0")
    _set(browser, "max-tokens", "12")
    _set(browser, "input", "def add(a, b):")
    browser.find_element(By.ID, "send").click()
    wait.until(lambda d: "finished" in d.find_element(By.ID, "status").text)
    assert [t.get_attribute("textContent") for t in browser.find_elements(By.CSS_SELECTOR, ".turn .who")] == ["you", "model"]
    spans = browser.find_elements(By.CSS_SELECTOR, ".turn.assistant .tok")
    llm = sluice.LLM()
    messages = [{"role": "user", "content": "def add(a, b):"}]
    ref = llm.chat(messages, sluice.SamplingParams(temperature=0, max_tokens=12, logprobs=TOP))
    assert [s.get_attribute("textContent") for s in spans] == [t.token for t in ref.logprobs]
    np.testing.assert_allclose([float(s.get_attribute("data-p")) for s in spans],
                               [math.exp(t.logprob) for t in ref.logprobs], rtol=1e-4)
    written = "".join(t.token for t in ref.logprobs)
    ids = llm.chat_prompt(messages) + llm.tokenizer.encode(written, add_special_tokens=False)
    wait.until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-valves-tokens") == str(len(ids)))
