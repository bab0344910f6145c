"""The playground page (service/http/playground.html, GET / of `pie serve --http-port`) in a real
headless Chromium driven by selenium (Debian's `chromium` and `chromium-driver`).

Two halves. Against a real `pie serve` on the bundled model, started with an API key: a greedy chat
of two turns and a seeded, sampled completion with a stop string are typed into the page, and what
streams in must equal the server's own non-streamed answer to the same request; TTFT and tokens/s
must show as numbers; a wrong key and max_tokens 0 must show the server's error message on the
page. Against the page opened from its file with `fetch` replaced (before the page's script runs)
by a stand-in server that sends chosen bytes in chosen pieces: events cut anywhere (inside a line,
inside a UTF-8 character) must come out whole, the stop button must abort the request in flight,
and network errors, error events and streams cut before `data: [DONE]` must show as text.

Without Chromium the test skips, except in CI (CI set), where it fails. PIE_SCREENSHOT=1
rewrites docs/playground.png from the chat of the first test.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.helpers import wait_until
from tests.service.browser import chromium
from tests.service.processes import ROOT, ServerProcess

# slow: starts `pie serve` and a browser
pytestmark = pytest.mark.slow

PAGE = ROOT / "service" / "http" / "playground.html"
SCREENSHOT = ROOT / "docs" / "playground.png"
KEY = "playground-test-key"
WAIT_S = 60


# ---- the browser ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    with chromium() as browser:
        yield browser


def by_id(driver, element_id: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id)


def text(driver, element_id: str) -> str:
    """The element's text exactly (WebElement.text trims and folds whitespace)."""
    return by_id(driver, element_id).get_property("textContent")


def fill(driver, **fields: Any) -> None:
    """Types into the page's fields by id (underscores for dashes); selects pick by value."""
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select

    for name, value in fields.items():
        element = by_id(driver, name.replace("_", "-"))
        if element.tag_name == "select":
            Select(element).select_by_value(str(value))
        else:
            element.clear()
            element.send_keys(str(value), Keys.TAB)  # TAB: leaving the field fires its `change`


def wait_for(driver, predicate, what: str):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, WAIT_S, poll_frequency=0.02).until(lambda d: predicate(d),
                                                                    message=f"timed out waiting for {what}")


def entries(driver) -> int:
    return driver.execute_script("return document.querySelectorAll('#messages li').length")


def ask(driver, prompt: str) -> str:
    """Sends `prompt` and waits for the answer to finish; returns its text."""
    before = entries(driver)
    fill(driver, prompt=prompt)
    by_id(driver, "send").click()
    wait_for(driver, lambda d: text(d, "status") == "error" or entries(d) == before + 2 and d.execute_script(
        "return document.querySelector('#messages li:last-child').getAttribute('aria-busy') === 'false'"),
        "the answer to finish")
    assert text(driver, "status") == "done" and not by_id(driver, "error").is_displayed(), text(driver, "error")
    return text(driver, "output")


def ask_error(driver, prompt: str, expected: str) -> None:
    """Sends `prompt`; the page must show the error `expected` and give the prompt back."""
    from selenium.common.exceptions import TimeoutException

    before = entries(driver)
    fill(driver, prompt=prompt)
    by_id(driver, "send").click()
    try:
        wait_for(driver, lambda d: text(d, "status") == "error" and text(d, "error") == expected, "the error")
    except TimeoutException:
        assert (text(driver, "status"), text(driver, "error")) == ("error", expected)
    assert by_id(driver, "error").is_displayed()
    assert entries(driver) == before and by_id(driver, "prompt").get_property("value") == prompt, \
        "a failed request leaves no entries and gives the prompt back"


def number(driver, element_id: str) -> float:
    value = float(text(driver, element_id))  # "–" where the page could not measure it
    assert value > 0, f"#{element_id} = {value}"
    return value


# ---- against the real server ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Served:
    base: str  # http://127.0.0.1:PORT
    process: ServerProcess  # its log lines, as events


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """`pie serve --http-port 0` on the bundled model, with one API key."""
    proc = ServerProcess(["--device", "cpu", "--port", "0", "--http-port", "0", "--api-key", KEY,
                          "--num-kv-blocks", "128"])
    try:
        port = wait_until(lambda: (proc.event("http_listening") or {}).get("port") or proc.proc.poll() is not None,
                          timeout=120, what="the HTTP door to listen")
        assert proc.proc.poll() is None, f"pie serve exited: {proc.events[-5:]}"
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _status(base + "/health") == 200, timeout=120, what="the server to be ready")
        yield Served(base, proc)
    finally:
        proc.finish()


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return -1


def call(base: str, path: str, body: dict | None = None, key: str = KEY) -> tuple[int, dict]:
    """(status, JSON body) of GET (body None) or POST `path`."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Authorization": f"Bearer {key}",
                                                                  "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=WAIT_S) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def open_playground(driver, base: str) -> str:
    """Opens the page, gives it the key, and waits for the model's name; returns it."""
    driver.get(base + "/")
    assert driver.title == "pie playground"
    # Without the key the model list is refused, and the page says so.
    wait_for(driver, lambda d: "401" in text(d, "error"), "the refused model list")
    fill(driver, api_key=KEY)
    _, models = call(base, "/v1/models")
    name = models["data"][0]["id"]
    wait_for(driver, lambda d: by_id(d, "model").get_property("value") == name, "the model's name")
    assert not by_id(driver, "error").is_displayed()
    return name


def test_chat_and_completion_stream_what_the_server_answers(driver, served):
    server = served.base
    model = open_playground(driver, server)
    sampling = {"temperature": 0, "top_p": 1, "max_tokens": 48, "seed": 5}
    fill(driver, mode="chat", max_tokens=48, temperature=0, top_p=1, seed=5)

    messages: list[dict] = []
    for prompt in ("Once upon a time, there was a little girl named Lily.", "One day, she found a red ball."):
        streamed = ask(driver, prompt)
        messages.append({"role": "user", "content": prompt})
        status, whole = call(server, "/v1/chat/completions", {"model": model, "messages": messages, **sampling})
        assert status == 200, whole
        expected = whole["choices"][0]["message"]["content"]
        assert streamed == expected and expected.strip()
        messages.append({"role": "assistant", "content": expected})
        usage = whole["usage"]
        assert text(driver, "usage") == f"{usage['prompt_tokens']} prompt + {usage['completion_tokens']} completion tokens"
        assert text(driver, "finish") == whole["choices"][0]["finish_reason"]
        number(driver, "ttft")
        # The server sends together what was generated since its last event (a loaded machine may
        # send a short answer whole); a rate needs the answer in two events at least. That the page
        # reads events in pieces is test_events_cut_anywhere_come_out_whole's.
        if int(by_id(driver, "output").get_attribute("data-chunks")) > 1:
            number(driver, "tps")
    if os.environ.get("PIE_SCREENSHOT") == "1":
        driver.save_screenshot(str(SCREENSHOT))

    fill(driver, mode="completion", temperature=0.8, top_p=0.9, max_tokens=40, seed=3, stop_string=".")
    streamed = ask(driver, "One sunny day,")
    status, whole = call(server, "/v1/completions", {"model": model, "prompt": "One sunny day,", "temperature": 0.8,
                                                     "top_p": 0.9, "max_tokens": 40, "seed": 3, "stop": "."})
    assert status == 200, whole
    assert streamed == whole["choices"][0]["text"] and "." not in streamed
    assert text(driver, "finish") == whole["choices"][0]["finish_reason"]
    number(driver, "ttft")


def test_stop_cancels_the_request_on_the_server(driver, served):
    model = open_playground(driver, served.base)
    body = {"model": model, "prompt": "Once upon a time", "temperature": 0, "max_tokens": 480}
    status, whole = call(served.base, "/v1/completions", body)
    assert status == 200, whole
    full = whole["choices"][0]["text"]
    assert whole["usage"]["completion_tokens"] >= 100, "long enough to stop halfway (~5 ms a token here)"

    fill(driver, mode="completion", temperature=0, max_tokens=480, prompt="Once upon a time")
    by_id(driver, "send").click()
    wait_for(driver, lambda d: d.execute_script("return document.getElementById('output')?.textContent"),
             "the first tokens")
    by_id(driver, "stop").click()
    wait_for(driver, lambda d: text(d, "status") in ("stopped", "done"), "the stop")
    shown = text(driver, "output")
    assert text(driver, "status") == "stopped" and full.startswith(shown) and len(shown) < len(full)
    assert not by_id(driver, "error").is_displayed()
    wait_until(lambda: any(e.get("event") == "request_done" and e.get("rpc") == "http/completions"
                           and e.get("status") == "CANCELLED" for e in list(served.process.events)),
               timeout=WAIT_S, what="the server to cancel the request")


def test_server_errors_show_on_the_page(driver, served):
    server = served.base
    model = open_playground(driver, server)
    fill(driver, mode="chat", max_tokens=0)
    status, body = call(server, "/v1/chat/completions", {"model": model, "max_tokens": 0,
                                                         "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 400, body
    ask_error(driver, "Hi", f"HTTP 400: {body['error']['message']}")

    fill(driver, max_tokens=8, api_key="not-the-key")
    status, body = call(server, "/v1/chat/completions", {"model": model, "max_tokens": 8,
                                                         "messages": [{"role": "user", "content": "Hi"}]},
                        key="not-the-key")
    assert status == 401, body
    ask_error(driver, "Hi", f"HTTP 401: {body['error']['message']}")


# ---- against a stand-in server -------------------------------------------------------------------

# Replaces `fetch` before the page's script runs. /v1/models names "fake-model"; a completion
# request is recorded and answered with window.__fake.pieces (byte arrays), one per read, 2 ms
# apart; with `hold` the body then stays open until the request's signal aborts it.
FAKE_FETCH = """
window.__fake = { pieces: [], hold: false, status: 200, reject: false, aborted: false, requests: [] };
window.fetch = async (url, init = {}) => {
  const fake = window.__fake;
  if (String(url).endsWith("/v1/models")) {
    return new Response(JSON.stringify({ object: "list", data: [{ id: "fake-model", object: "model" }] }));
  }
  fake.requests.push({ url: String(url), headers: init.headers, body: JSON.parse(init.body) });
  if (fake.reject) throw new TypeError("Failed to fetch");
  const pieces = fake.pieces.map((p) => new Uint8Array(p));
  const body = new ReadableStream({
    async pull(controller) {
      if (pieces.length > 0) {
        await new Promise((resolve) => setTimeout(resolve, 2));
        controller.enqueue(pieces.shift());
      } else if (!fake.hold) {
        controller.close();
      } else {
        await new Promise((resolve) => init.signal.addEventListener("abort", resolve, { once: true }));
        fake.aborted = true;
        controller.error(new DOMException("The user aborted a request.", "AbortError"));
      }
    },
  });
  return new Response(body, { status: fake.status, headers: { "Content-Type": "text/event-stream" } });
};
"""

DELTAS = ["Once", " upon", " a café", " 日本", " time 😀", "\n\nThe end."]


def chat_events(deltas: list[str], *, end: bool = True) -> str:
    """A chat stream as the server sends it, with the liberties SSE allows: CRLF line ends, a
    comment, `data:` without its space. end=False: only the deltas (no finish, usage or [DONE])."""
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "fake-model"}
    events = [{**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    events += [{**chunk, "choices": [{"index": 0, "delta": {"content": d}}]} for d in deltas]
    if end:
        events += [{**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                   {**chunk, "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": len(deltas),
                                                      "total_tokens": 7 + len(deltas)}}]
    lines = [f"data: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events]
    lines[1] = lines[1].replace("\n", "\r\n")
    if len(lines) > 2:
        lines[2] = ": keep-alive\n\n" + lines[2].replace("data: ", "data:")
    return "".join(lines) + ("data: [DONE]\n\n" if end else "")


def cut(text: str, rng) -> list[list[int]]:
    """The UTF-8 bytes of `text` in pieces of 1 to 7 bytes, every multi-byte character cut after
    its first byte."""
    data = text.encode()
    cuts, at = set(), 0
    for char in text:
        if len(char.encode()) > 1:
            cuts.add(at + 1)
        at += len(char.encode())
    at = 0
    while at < len(data):
        at += rng.randint(1, 7)
        cuts.add(at)
    bounds = [0, *sorted(c for c in cuts if c < len(data)), len(data)]
    return [list(data[a:b]) for a, b in zip(bounds, bounds[1:])]


@pytest.fixture
def fake(driver) -> Iterator[Any]:
    """The page opened from its file, with FAKE_FETCH in place of `fetch`."""
    script = driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": FAKE_FETCH})
    try:
        driver.get(PAGE.as_uri())
        wait_for(driver, lambda d: by_id(d, "model").get_property("value") == "fake-model", "the model's name")
        yield driver
    finally:
        driver.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", {"identifier": script["identifier"]})


def serve(driver, **fake: Any) -> None:
    for key, value in fake.items():
        driver.execute_script(f"window.__fake.{key} = arguments[0]", value)


def test_events_cut_anywhere_come_out_whole(fake, rng):
    serve(fake, pieces=cut(chat_events(DELTAS), rng))
    fill(fake, api_key="sk-test", temperature=0.5, top_p=0.9, max_tokens=20, seed=11, stop_string="END")
    assert ask(fake, "Once") == "".join(DELTAS)
    assert by_id(fake, "output").get_attribute("data-chunks") == str(len(DELTAS))
    assert text(fake, "finish") == "stop" and text(fake, "usage") == f"7 prompt + {len(DELTAS)} completion tokens"
    number(fake, "ttft"), number(fake, "tps")

    request = fake.execute_script("return window.__fake.requests.at(-1)")
    assert request["url"].endswith("/v1/chat/completions")
    assert request["headers"]["Authorization"] == "Bearer sk-test"
    assert request["body"] == {"model": "fake-model", "stream": True, "stream_options": {"include_usage": True},
                               "temperature": 0.5, "top_p": 0.9, "max_tokens": 20, "seed": 11, "stop": "END",
                               "messages": [{"role": "user", "content": "Once"}]}

    # The next turn carries the conversation; a completion sends its prompt alone.
    serve(fake, pieces=cut(chat_events(["Twice"]), rng))
    assert ask(fake, "Again") == "Twice"
    assert fake.execute_script("return window.__fake.requests.at(-1).body.messages") == [
        {"role": "user", "content": "Once"}, {"role": "assistant", "content": "".join(DELTAS)},
        {"role": "user", "content": "Again"}]
    completion = "data: " + json.dumps({"choices": [{"index": 0, "text": "Thrice", "finish_reason": "length"}]})
    serve(fake, pieces=cut(completion + "\n\ndata: [DONE]\n\n", rng))
    fill(fake, mode="completion")
    assert ask(fake, "Count:") == "Thrice" and text(fake, "finish") == "length"
    request = fake.execute_script("return window.__fake.requests.at(-1)")
    assert request["url"].endswith("/v1/completions") and request["body"]["prompt"] == "Count:"
    assert "messages" not in request["body"]


def test_stop_aborts_the_request(fake, rng):
    serve(fake, pieces=cut(chat_events(DELTAS[:2], end=False), rng), hold=True)
    fill(fake, prompt="Once")
    by_id(fake, "send").click()
    wait_for(fake, lambda d: text(d, "output") == "Once upon", "the first tokens")
    assert by_id(fake, "send").get_property("disabled") and text(fake, "status") == "streaming…"
    assert not fake.execute_script("return window.__fake.aborted")
    by_id(fake, "stop").click()
    wait_for(fake, lambda d: text(d, "status") == "stopped", "the stop")
    assert fake.execute_script("return window.__fake.aborted")
    assert text(fake, "output") == "Once upon" and not by_id(fake, "error").is_displayed()
    assert not by_id(fake, "send").get_property("disabled") and by_id(fake, "stop").get_property("disabled")


@pytest.mark.parametrize("case", ["network", "http", "error event", "cut short"])
def test_failures_show_as_text(fake, rng, case):
    error_body = {"error": {"message": "the queue is full", "type": "server_error", "param": None, "code": None}}
    if case == "network":
        serve(fake, reject=True)
    elif case == "http":
        serve(fake, status=429, pieces=cut(json.dumps(error_body), rng))
    elif case == "error event":
        serve(fake, pieces=cut(chat_events(DELTAS[:1], end=False)
                               + f"data: {json.dumps(error_body)}\n\ndata: [DONE]\n\n", rng))
    else:
        serve(fake, pieces=cut(chat_events(DELTAS[:1], end=False), rng))
    before = entries(fake)
    fill(fake, prompt="Once")
    by_id(fake, "send").click()
    wait_for(fake, lambda d: text(d, "status") == "error", "the error")
    shown = text(fake, "error")
    assert by_id(fake, "error").is_displayed()
    assert shown == {"network": "Network error: Failed to fetch", "http": "HTTP 429: the queue is full",
                     "error event": "the queue is full",
                     "cut short": "The stream ended before its last event (data: [DONE])."}[case]
    if case in ("network", "http"):  # nothing came: the prompt is given back
        assert entries(fake) == before and by_id(fake, "prompt").get_property("value") == "Once"
    else:  # what came stays
        assert text(fake, "output") == "Once"


def test_the_page_loads_nothing_from_elsewhere():
    html = PAGE.read_text()
    assert "://" not in html
    assert "<link" not in html and "src=" not in html and "@import" not in html and "url(" not in html
    assert len(html.splitlines()) <= 400
