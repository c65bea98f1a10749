"""The playground page at `/`, driven in headless chromium against real stacks: a reply streams in
with its TTFT and tokens/s, the workers panel shows the worker, Stop cancels a generation,
tools give tool-call blocks, and the load charts move while a load runs.

Needs Debian's chromium and chromedriver (scripts/ensure-browser.sh, which `make test` runs); the
test fails, never skips, without them. Screenshots are saved under the test's tmp_path and, when
STREAMQ_ARTIFACTS is set, copied there.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from pydantic import BaseModel, ConfigDict, Field
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select, WebDriverWait

from shared.messages import FinishReason, RequestStatus
from tests.stack import ROOT, Stack, stream_events
from streamq.testing.tiny_models import build_model

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
NUMBER = re.compile(r"^\d+(\.\d+)?( ms)?$")
WAIT_S = 60  # an upper bound for the page to catch up, never a pause


class Forecast(BaseModel):
    """The forecast function's parameters."""

    model_config = ConfigDict(extra="forbid")

    days: int = Field(ge=1, le=7)


FORECAST = {"type": "function", "function": {
    "name": "forecast", "description": "The weather for the next days.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["days"],
                   "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}


@pytest.fixture(scope="module")
def browser() -> WebDriver:
    binary = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    driver_path = shutil.which("chromedriver")
    if binary is None or driver_path is None:
        pytest.fail("the playground test needs chromium and chromedriver on PATH, and found "
                    f"browser={binary}, chromedriver={driver_path}: run scripts/ensure-browser.sh "
                    "(`make test` does) or `sudo apt-get install chromium chromium-driver`", pytrace=False)
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(flag)
    # Both paths given, so selenium never tries to download a browser or a driver.
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def secured_null(redis_url, tiny_llama, tmp_path_factory) -> Stack:
    """API keys on, and the null backend at 10 tokens/s: a 200-token request runs for 20 s, far
    longer than it takes to press Stop, so the stop is never raced by the request's end."""
    env = {"STREAMQ_AUTH": "on", "STREAMQ_BACKEND": "null", "STREAMQ_NULL_TOKENS_PER_S": "10"}
    with Stack(redis_url, tiny_llama, tmp_path_factory.mktemp("playground-null"), env=env) as running:
        yield running


@pytest.fixture(scope="module")
def long_llama(redis_url, tmp_path_factory) -> Stack:
    """A tiny llama of 2,048 positions: the tools' description in the prompt outgrows 256."""
    model = build_model(tmp_path_factory.mktemp("tiny-llama-long"), "llama", context=2048)
    with Stack(redis_url, model, tmp_path_factory.mktemp("playground-tools")) as running:
        yield running


def wait(driver: WebDriver, condition, what: str):
    def describe() -> str:
        return f"{what}; page state {driver.find_element(By.TAG_NAME, 'body').get_attribute('data-state')!r}, " \
               f"error {driver.find_element(By.ID, 'error').get_property('textContent')!r}"
    try:
        return WebDriverWait(driver, WAIT_S, poll_frequency=0.02).until(condition)
    except Exception as exc:
        raise AssertionError(f"timed out waiting for: {describe()}") from exc


def text_of(driver: WebDriver, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).get_property("textContent")


def set_field(driver: WebDriver, element_id: str, value: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(value)


def send(driver: WebDriver, prompt: str) -> None:
    set_field(driver, "prompt", prompt)
    driver.find_element(By.ID, "send").click()


def page_state(driver: WebDriver) -> str:
    return driver.find_element(By.TAG_NAME, "body").get_attribute("data-state")


def replied(driver: WebDriver, replies: int) -> bool:
    """The page has ended its `replies`-th reply (its item and its state are set in one task)."""
    items = driver.find_elements(By.CSS_SELECTOR, "#messages li.assistant")
    return len(items) == replies and page_state(driver) == "done"


def last_reply(driver: WebDriver) -> str:
    replies = driver.find_elements(By.CSS_SELECTOR, "#messages li.assistant .text")
    return replies[-1].get_property("textContent") if replies else ""


def worker_rows(driver: WebDriver) -> list[list[str]]:
    return [[cell.get_property("textContent") for cell in row.find_elements(By.TAG_NAME, "td")]
            for row in driver.find_elements(By.CSS_SELECTOR, "#workers tr")]


def screenshot(driver: WebDriver, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    driver.save_screenshot(str(path))
    if folder := os.environ.get("STREAMQ_ARTIFACTS"):
        Path(folder).mkdir(parents=True, exist_ok=True)
        path = Path(shutil.copy(path, Path(folder) / name))
    print(f"playground screenshot: {path}")
    return path


def test_a_reply_streams_in_with_its_timings_and_the_worker_is_listed(browser, stack, tmp_path):
    api = stack.urls[0]
    page = httpx.get(f"{api}/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    paths = httpx.get(f"{api}/openapi.json", timeout=30).json()["paths"]
    assert "/" not in paths and "/static/{name}" not in paths and "/v1/cluster" in paths

    browser.get(f"{api}/")
    try:
        # The workers panel: one live worker, with its model, backend and free KV blocks.
        wait(browser, lambda d: len(rows := worker_rows(d)) == 1 and rows[0][1] == stack.model_name
             and re.match(r"^\d+/\d+$", rows[0][4]), "one worker row with the model and its free KV")
        assert worker_rows(browser)[0][:3] == [stack.worker_name(0), stack.model_name, "hf"]
        assert text_of(browser, "queue-waiting") == "0"
        assert text_of(browser, "model") == stack.model_name

        set_field(browser, "temperature", "0")
        set_field(browser, "max_tokens", "24")
        browser.find_element(By.ID, "ignore_eos").click()
        send(browser, "What is the capital of France?")
        wait(browser, lambda d: last_reply(d) != "", "the first token on the page")
        wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state") == "done",
             "the final event")
        assert NUMBER.match(text_of(browser, "ttft")) and NUMBER.match(text_of(browser, "tps"))
        assert text_of(browser, "tokens") == "24" and text_of(browser, "finish") == "length"

        # What the page assembled from the stream is exactly the request's text on the server.
        request_id = browser.find_element(By.TAG_NAME, "body").get_attribute("data-request-id")
        state = httpx.get(f"{api}/v1/requests/{request_id}", timeout=30).json()
        assert state["status"] == "done" and state["completion_tokens"] == 24
        assert last_reply(browser) == state["text"]
        # Everything the page loaded came from the api itself.
        origins = browser.execute_script(
            "return performance.getEntriesByType('resource').map(e => new URL(e.name).origin)")
        assert origins and set(origins) == {api}
    finally:
        screenshot(browser, tmp_path, "playground.png")


def test_stop_cancels_the_generation_and_a_key_is_asked_for(browser, secured_null, tmp_path):
    api = secured_null.urls[0]
    # The admin tenant's: the page's worker panel is the operator's cluster view.
    key = subprocess.run([sys.executable, "-m", "streamq.cli", "keys", "create", "--tenant", "admin"],
                         cwd=ROOT, env=secured_null.env, capture_output=True, text=True, timeout=60,
                         check=True).stdout.strip()
    assert httpx.get(f"{api}/v1/cluster", timeout=30).status_code == 401
    assert httpx.get(f"{api}/", timeout=30).status_code == 200  # the page itself needs no key

    browser.get(f"{api}/")
    try:
        auth = browser.find_element(By.ID, "auth")
        wait(browser, lambda d: auth.is_displayed(), "the API key form after a 401")
        set_field(browser, "api-key", key)
        auth.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        wait(browser, lambda d: [row[1:3] for row in worker_rows(d)] == [[secured_null.model_name, "null"]],
             "the worker row once the key is sent")

        set_field(browser, "max_tokens", "200")
        send(browser, "Tell me a long story.")
        wait(browser, lambda d: last_reply(d) != "", "the first token of the long reply")
        request_id = browser.find_element(By.TAG_NAME, "body").get_attribute("data-request-id")
        browser.find_element(By.ID, "stop").click()
        wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state") == "cancelled",
             "the page to show the request cancelled")

        state = httpx.get(f"{api}/v1/requests/{request_id}", params={"wait": 10}, timeout=30,
                          headers={"Authorization": f"Bearer {key}"}).json()
        assert state["status"] == "cancelled" and state["finish_reason"] == "cancelled"
        assert 1 <= state["completion_tokens"] < 200
        assert browser.find_element(By.ID, "send").is_enabled() and not browser.find_element(By.ID, "stop").is_enabled()

        # With tools the chat goes through the OpenAI endpoint, which gives the page no request id
        # to DELETE: Stop closes the stream, and that cancels the request.
        browser.find_element(By.ID, "clear").click()  # a short history: the prompt and max_tokens fit 256
        set_field(browser, "tools", json.dumps([FORECAST]))
        Select(browser.find_element(By.ID, "tool_choice")).select_by_value("none")  # a plain answer, streamed
        set_field(browser, "max_tokens", "199")
        send(browser, "Another long story.")
        wait(browser, lambda d: last_reply(d) != "", "the first token over the OpenAI endpoint")
        browser.find_element(By.ID, "stop").click()
        wait(browser, lambda d: page_state(d) == "stopped", "the page to show the stream stopped")
        record = secured_null.wait_for_record(lambda r: '"max_tokens":199' in (r.params or "")
                                              and r.status != RequestStatus.RUNNING)
        assert (record.status, record.finish_reason) == (RequestStatus.CANCELLED, FinishReason.CANCELLED)
    finally:
        screenshot(browser, tmp_path, "playground-stopped.png")


def test_a_json_schema_constrains_the_reply_and_a_bad_one_is_shown(browser, stack, tmp_path):
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "ok"],
              "properties": {"city": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}}}
    browser.get(f"{stack.urls[0]}/")
    try:
        set_field(browser, "temperature", "0")
        set_field(browser, "max_tokens", "120")
        set_field(browser, "json_schema", json.dumps(schema))
        send(browser, "A city, as JSON.")
        wait(browser, lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state") == "done",
             "the final event")
        reply = json.loads(last_reply(browser))
        assert set(reply) == {"city", "ok"} and isinstance(reply["ok"], bool)
        assert text_of(browser, "finish") == "stop"

        set_field(browser, "json_schema", '{"type": "nonsense"}')
        send(browser, "Again.")
        wait(browser, lambda d: "nonsense" in text_of(d, "error"), "the api's refusal on the page")
        set_field(browser, "json_schema", "{not json")
        send(browser, "Again.")
        wait(browser, lambda d: "not valid JSON" in text_of(d, "error"), "the page's own refusal")
    finally:
        screenshot(browser, tmp_path, "playground-json-schema.png")


def test_tools_give_a_tool_call_block_that_goes_back_with_the_history(browser, long_llama, tmp_path):
    browser.get(f"{long_llama.urls[0]}/")
    try:
        set_field(browser, "temperature", "0")
        set_field(browser, "max_tokens", "200")
        set_field(browser, "tools", json.dumps([FORECAST]))
        Select(browser.find_element(By.ID, "tool_choice")).select_by_value("required")
        send(browser, "The weather this week?")
        wait(browser, lambda d: replied(d, 1), "the tool call's final chunk")
        blocks = browser.find_elements(By.CSS_SELECTOR, "#messages li.assistant .tool-call")
        assert blocks and last_reply(browser) == ""
        for block in blocks:
            assert block.find_element(By.CLASS_NAME, "tool-name").get_property("textContent") == "forecast"
            arguments = block.find_element(By.CLASS_NAME, "tool-arguments").get_property("textContent")
            Forecast.model_validate_json(arguments)
        assert text_of(browser, "finish") == "tool_calls" and int(text_of(browser, "tokens")) > 0
        screenshot(browser, tmp_path, "playground-tool-call.png")

        # The call goes back with the history: as tool_calls to the OpenAI endpoint, then as the
        # model's text to the native api (which would refuse tool_calls in a message).
        Select(browser.find_element(By.ID, "tool_choice")).select_by_value("none")
        set_field(browser, "max_tokens", "4")
        send(browser, "Thanks.")
        wait(browser, lambda d: replied(d, 2), "a plain answer with tools present")
        set_field(browser, "tools", "")
        send(browser, "Bye.")
        wait(browser, lambda d: replied(d, 3), "the native api's answer after the tool call")
        assert len(browser.find_elements(By.CSS_SELECTOR, "#messages .tool-call")) == len(blocks)

        set_field(browser, "tools", "[{not json")
        send(browser, "Again.")
        wait(browser, lambda d: "Tools: not valid JSON" in text_of(d, "error"), "the page's own refusal")
        set_field(browser, "tools", json.dumps([FORECAST]))
        Select(browser.find_element(By.ID, "tool_choice")).select_by_value("auto")  # under none, no tool constraint
        set_field(browser, "json_schema", '{"type": "object"}')
        send(browser, "Again.")
        wait(browser, lambda d: "tools cannot be combined" in text_of(d, "error"), "the api's refusal on the page")
        assert len(browser.find_elements(By.CSS_SELECTOR, "#messages li.assistant")) == 3
    finally:
        screenshot(browser, tmp_path, "playground-tools.png")


@pytest.fixture(scope="module")
def slow_null(redis_url, tmp_path_factory) -> Stack:
    """The null backend at 10 tokens/s: a 30-token reply takes 3 s, longer than a page reload; on
    a tiny llama of 2,048 positions, which the second turn's conversation needs."""
    model = build_model(tmp_path_factory.mktemp("tiny-llama-2k"), "llama", context=2048)
    env = {"STREAMQ_BACKEND": "null", "STREAMQ_NULL_TOKENS_PER_S": "10"}
    with Stack(redis_url, model, tmp_path_factory.mktemp("playground-responses"), env=env) as running:
        yield running


def test_responses_mode_resumes_a_reply_after_a_reload(browser, slow_null, tmp_path):
    """A background response streams in; the page is reloaded mid-reply and goes on from the last
    sequence number it saw: the reply on the page is exactly the stored response's text. The
    next turn continues it by previous_response_id."""
    api = slow_null.urls[0]
    browser.get(f"{api}/")
    try:
        browser.find_element(By.ID, "responses-mode").click()
        set_field(browser, "max_tokens", "30")
        send(browser, "Tell me a story")
        wait(browser, lambda d: last_reply(d) != "", "the first text of the response")
        pending = browser.execute_script("return JSON.parse(sessionStorage.getItem('streamq.responses')).pending")
        response_id = pending["id"]
        browser.refresh()
        wait(browser, lambda d: page_state(d) in ("completed", "incomplete"), "the resumed reply's end")
        stored = httpx.get(f"{api}/v1/responses/{response_id}", timeout=30).json()
        text = stored["output"][0]["content"][0]["text"]
        assert last_reply(browser) == text and stored["usage"]["output_tokens"] == 30
        events = httpx.get(f"{api}/v1/responses/{response_id}", params={"stream": "true"}, timeout=30).text
        last = max(json.loads(line[6:])["sequence_number"] for line in events.splitlines() if line.startswith("data: "))
        assert pending["seq"] < last  # the reload came before the end: the page resumed mid-reply
        assert text_of(browser, "finish") == "max_output_tokens"
        assert len(browser.find_elements(By.CSS_SELECTOR, "#messages li.user")) == 1

        set_field(browser, "max_tokens", "30")  # the reload reset the page's fields
        send(browser, "And then?")
        wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#messages li.assistant")) == 2
             and page_state(d) in ("completed", "incomplete"), "the second turn's end")
        second = browser.find_element(By.TAG_NAME, "body").get_attribute("data-response-id")
        assert httpx.get(f"{api}/v1/responses/{second}", timeout=30).json()["previous_response_id"] == response_id
    finally:
        screenshot(browser, tmp_path, "playground-responses.png")
        browser.execute_script("sessionStorage.clear()")


def chart_data(driver: WebDriver) -> dict[str, list[list]]:
    """Each load chart's data as its uPlot instance holds it: times, then each series."""
    return driver.execute_script("return Object.fromEntries(Object.entries(charts).map(([n, c]) => [n, c.data]))")


def under_load(data: dict[str, list[list]], since: int) -> bool:
    """Samples taken after the first `since` show tokens/s in 5 of them, and requests waiting,
    requests running and a TTFT in some."""
    def later(chart: str, series: int) -> list:
        return [v for v in data[chart][series][since:] if v]
    return (len(later("tokens", 1)) >= 5 and later("queue", 1) != [] and later("queue", 2) != []
            and later("ttft", 1) != [])


def test_the_load_charts_move_while_a_load_runs(browser, slow_null, tmp_path):
    """More clients than the worker has slots keep requests going until the page's charts show
    the load (from the workers' heartbeats): tokens/s, requests waiting and running, and a TTFT,
    in samples taken while it runs."""
    api = slow_null.urls[0]
    browser.get(f"{api}/")
    try:
        assert len(browser.find_elements(By.CSS_SELECTOR, "#charts .chart canvas")) == 3
        # The ring keeps the last 5 minutes of samples.
        assert browser.execute_script("""const ring = new Ring(["a"]);
            for (let t = 0; t <= 600; t += 2) ring.push(t, {a: t});
            return [ring.columns[0][0], ring.columns[0].length, ring.columns[1].at(-1)]""") == [300, 151, 600]
        wait(browser, lambda d: len(chart_data(d)["tokens"][0]) >= 1, "the first sample on the charts")
        since = len(chart_data(browser)["tokens"][0])
        capacity = httpx.get(f"{api}/v1/cluster", timeout=30).json()["workers"][0]["capacity"]
        stop = threading.Event()

        def client() -> None:
            with httpx.Client(timeout=60) as http:
                while not stop.is_set():
                    events = stream_events(http, "POST", f"{api}/v1/requests", json={
                        "prompt": "Count to ten.", "max_tokens": 10, "ignore_eos": True, "stream": True})
                    assert events[-1]["data"]["status"] == "done"

        with ThreadPoolExecutor(capacity + 4) as pool:
            clients = [pool.submit(client) for _ in range(capacity + 4)]
            try:
                wait(browser, lambda d: under_load(chart_data(d), since), "the load on the charts")
                browser.execute_script("document.getElementById('load').scrollIntoView()")
                screenshot(browser, tmp_path, "playground-charts.png")
            finally:
                stop.set()
            for done in clients:
                done.result()  # a client's failure fails the test

        times = chart_data(browser)["tokens"][0]
        assert len(times) > since and times == sorted(set(times))
    finally:
        if not (tmp_path / "playground-charts.png").exists():
            screenshot(browser, tmp_path, "playground-charts.png")  # what the page showed when it failed


@pytest.fixture(scope="module")
def llava(redis_url, tmp_path_factory) -> tuple[Stack, Path]:
    """A tiny LLaVA-1.5 (streamq/testing/tiny_vision.py): a model that takes images."""
    from streamq.testing.tiny_vision import build_llava

    folder = build_llava(tmp_path_factory.mktemp("playground-llava"))
    with Stack(redis_url, folder, tmp_path_factory.mktemp("playground-images")) as running:
        yield running, folder


def test_an_image_picked_pasted_or_dropped_goes_with_the_message(browser, llava, tmp_path):
    """Picked with the file button, pasted into the prompt, dropped on the composer: each shows as a
    thumbnail, goes with the message (a thumbnail in the conversation) and the reply is the model's
    answer to that picture and text, as transformers gives it; removing a thumbnail leaves it out."""
    import base64

    from streamq.testing.tiny_vision import png
    from tests.e2e.test_images import _reference

    stack, folder = llava
    pictures = {"picked": png(21), "pasted": png(22, (30, 44)), "dropped": png(23, (52, 20))}
    browser.get(f"{stack.urls[0]}/")
    try:
        set_field(browser, "temperature", "0")
        set_field(browser, "max_tokens", "8")
        for how, picture in pictures.items():
            browser.find_element(By.ID, "clear").click()
            if how == "picked":
                path = tmp_path / "picked.png"
                path.write_bytes(picture)
                browser.find_element(By.ID, "image-file").send_keys(str(path))
            else:  # a clipboard's or a drag's file, as the browser hands it to the page
                event = "paste" if how == "pasted" else "drop"
                target = "prompt" if how == "pasted" else "composer"
                browser.execute_script(f"""
                    const bytes = Uint8Array.from(atob(arguments[0]), c => c.charCodeAt(0));
                    const data = new DataTransfer();
                    data.items.add(new File([bytes], "image.png", {{type: "image/png"}}));
                    const init = {{bubbles: true, cancelable: true}};
                    const e = "{event}" === "paste" ? new ClipboardEvent("paste", {{...init, clipboardData: data}})
                                                   : new DragEvent("drop", {{...init, dataTransfer: data}});
                    document.getElementById("{target}").dispatchEvent(e);""", base64.b64encode(picture).decode())
            wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#attachments img.thumb")) == 1,
                 f"the {how} image's thumbnail")
            send(browser, "What is in the picture?")
            wait(browser, lambda d: replied(d, 1), f"the reply to the {how} image")
            assert browser.find_elements(By.CSS_SELECTOR, "#messages li.user img.thumb")
            assert not browser.find_elements(By.CSS_SELECTOR, "#attachments img.thumb")
            assert last_reply(browser) == _reference(folder, [picture, "What is in the picture?"]), how
            if how == "picked":
                screenshot(browser, tmp_path, "playground-image-sent.png")
        # A thumbnail removed before sending: the message goes as text alone.
        browser.find_element(By.ID, "clear").click()
        browser.find_element(By.ID, "image-file").send_keys(str(tmp_path / "picked.png"))
        wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#attachments img.thumb")) == 1, "a thumbnail")
        browser.find_element(By.CSS_SELECTOR, "#attachments button").click()
        send(browser, "What is in the picture?")
        wait(browser, lambda d: replied(d, 1), "the reply without the image")
        assert last_reply(browser) == _reference(folder, ["What is in the picture?"])
    finally:
        screenshot(browser, tmp_path, "playground-images.png")
