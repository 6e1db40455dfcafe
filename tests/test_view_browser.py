"""`sdpa view` in a real browser: Debian's Chromium driven by Playwright (no download).

The page's numbers are read back from the DOM (each token's data-w, the pixel map's
data-weights, the hover line) and compared with the lazy weights w[0, h, i] the server
answers from. One browser for the module; servers run in this process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported

from playwright import sync_api  # the browser extra: no skip without it

from sdpa.nn import pixel_attention
from sdpa.view.export import write_html
from sdpa.view.server import ViewServer
from sdpa.view.session import text_session, unet_session
from test_view import TEXT, document, make_model_folder

CHROMIUM = next(
    (p for p in ("/usr/bin/chromium", shutil.which("chromium") or "") if p and Path(p).exists()),
    None,
)
FLAGS = [
    *("--no-sandbox", "--headless", "--disable-gpu", "--disable-quic", "--no-first-run"),
    *("--disable-background-networking", "--disable-component-update", "--disable-sync"),
]
TIMEOUT_MS = 30_000


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if CHROMIUM is None:
        pytest.skip(
            "no Chromium binary: install it with `sudo apt-get install chromium` "
            "(or run `make test` as root, which installs it)"
        )
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),  # a fresh user-data-dir
            executable_path=CHROMIUM, args=FLAGS, headless=True,
            viewport={"width": 1200, "height": 800},
        )  # fmt: skip
        yield context
        context.close()


class Page:
    """One open page and every request it made."""

    def __init__(self, context, url: str):
        self.page = context.new_page()
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.set_default_timeout(TIMEOUT_MS)
        self.page.goto(url)
        self.page.wait_for_selector("body[data-ready='1']")

    def shown(self, layer, head, query) -> None:
        """Wait until the page shows this selection (coloured and painted)."""
        self.page.wait_for_selector(f"body[data-shown='{layer}/{head}/{query}']", state="attached")

    def head(self, layer, head) -> None:
        self.page.click(f"#grid button[data-layer='{layer}'][data-head='{head}']")

    def token_weights(self) -> torch.Tensor:
        got = self.page.eval_on_selector_all(".tok", "els => els.map(e => Number(e.dataset.w))")
        return torch.tensor(got, dtype=torch.float64)

    def close(self):
        self.page.close()


@pytest.fixture(scope="module")
def bert():
    session = text_session(TEXT)
    server = ViewServer(session)
    server.start()
    yield session, server
    server.stop()


def test_page_loads_with_no_external_request(browser, bert):
    session, server = bert
    page = Page(browser, server.url)
    assert page.requests and all(u.startswith(server.url) for u in page.requests), page.requests
    assert page.page.locator(".tok").count() == session.length
    assert page.page.locator("#grid button").count() == 6 * 13  # 12 heads and the mean
    texts = page.page.eval_on_selector_all(".tok", "els => els.map(e => e.textContent)")
    assert texts[0] == "[CLS]" and "deposited" in texts and "river" in texts
    assert not page.errors, page.errors
    page.close()


@pytest.mark.parametrize("layer,head,query", [(0, 0, 3), (4, 9, 11)])
def test_clicking_a_token_shows_its_row(browser, bert, layer, head, query):
    session, server = bert
    page = Page(browser, server.url)
    page.head(layer, head)
    page.page.locator(".tok").nth(query).click()
    page.shown(layer, head, query)
    expected = session.weights[layer][0, head, query].double()
    torch.testing.assert_close(page.token_weights(), expected, atol=1e-6, rtol=0)
    assert page.page.locator(".tok.query").count() == 1
    # hover: the weight of one token, from this query, named
    page.page.locator(".tok").nth(5).hover()
    hover = page.page.locator("#hover").text_content()
    word = page.page.locator(".tok").nth(5).text_content()
    shown = re.fullmatch(rf'"{re.escape(word)}" \(#5\): weight (\S+) from query .*', hover)
    assert shown and abs(float(shown[1]) - float(expected[5])) <= 1e-5 * float(expected[5]), hover
    assert f"(#{query})" in hover and f"layer {layer}, head {head}" in hover
    # keyboard: the next token's row
    page.page.keyboard.press("ArrowRight")
    page.shown(layer, head, query + 1)
    expected = session.weights[layer][0, head, query + 1].double()
    torch.testing.assert_close(page.token_weights(), expected, atol=1e-6, rtol=0)
    assert not page.errors, page.errors
    page.close()


def test_head_average(browser, bert):
    session, server = bert
    page = Page(browser, server.url)
    page.head(2, "mean")
    page.page.locator(".tok").nth(7).click()
    page.shown(2, "mean", 7)
    expected = session.weights[2][0, :, 7].double().mean(0)
    torch.testing.assert_close(page.token_weights(), expected, atol=1e-6, rtol=0)
    assert "head average" in page.page.locator("#status").text_content()
    page.page.keyboard.press("Escape")  # back to attention received
    page.shown(2, "mean", "")
    received = torch.tensor(session.head_stats(2, "mean")["received"], dtype=torch.float64)
    torch.testing.assert_close(page.token_weights(), received, atol=1e-6, rtol=0)
    page.close()


def test_a_late_answer_does_not_overwrite_a_newer_selection(browser, bert, monkeypatch):
    """A head's statistics that come back after the row clicked since (a slow /head):
    the page keeps showing the row, its status line included."""
    session, server = bert
    real = session.head_stats

    def slow(*args):
        time.sleep(1.0)
        return real(*args)

    monkeypatch.setattr(session, "head_stats", slow)
    page = Page(browser, server.url)
    page.head(1, 3)  # asks /head (slow)
    page.page.locator(".tok").nth(4).click()  # asks /row, answered first
    page.shown(1, 3, 4)
    page.page.wait_for_timeout(1500)  # the /head answer has come back by now
    status = page.page.locator("#status").text_content()
    assert "attends to" in status and "receives" not in status, status
    assert page.page.get_attribute("body", "data-shown") == "1/3/4"
    page.close()


def test_bad_parameters_from_the_page_get_4xx(browser, bert):
    _, server = bert
    page = Page(browser, server.url)
    statuses = page.page.evaluate(
        """() => Promise.all(['row?layer=99&head=0&query=0', 'row?layer=0&head=x&query=0',
            'row?layer=0&head=0', 'nothing'].map(u => fetch(u).then(r => r.status)))"""
    )
    assert statuses == [400, 400, 400, 404]
    page.close()


def test_pixel_click_in_the_unet_view(browser):
    session = unet_session()
    server = ViewServer(session)
    server.start()
    try:
        page = Page(browser, server.url)
        page.page.click("#grid button[data-head='2']")
        box = page.page.locator("#picture").bounding_box()
        y, x = 35, 18  # the house
        page.page.mouse.click(box["x"] + (x + 0.5) * box["width"] / 64,
                              box["y"] + (y + 0.5) * box["height"] / 64)  # fmt: skip
        page.shown(0, 2, y * 64 + x)
        got = json.loads(page.page.get_attribute("#map", "data-weights"))
        expected = pixel_attention(session.weights[0], y, x, (64, 64))[0, 2].flatten()
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), expected.double(),
                                   atol=1e-6, rtol=0)  # fmt: skip
        assert "pixel (35, 18)" in page.page.locator("#status").text_content()
        page.page.click("#grid button[data-head='mean']")
        page.shown(0, "mean", y * 64 + x)
        got = json.loads(page.page.get_attribute("#map", "data-weights"))
        mean = pixel_attention(session.weights[0], y, x, (64, 64))[0].mean(0).flatten()
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), mean.double(),
                                   atol=1e-6, rtol=0)  # fmt: skip
        page.page.mouse.move(
            box["x"] + 3.5 * box["width"] / 64, box["y"] + 60.5 * box["height"] / 64
        )
        assert "pixel (60, 3): weight" in page.page.locator("#hover").text_content()
        assert all(u.startswith(server.url) for u in page.requests) and not page.errors
        page.close()
    finally:
        server.stop()


def test_static_export_answers_from_the_file(browser, bert, tmp_path):
    session, _ = bert
    path = write_html(session, tmp_path / "view.html")
    page = Page(browser, path.as_uri())
    assert page.requests == [path.as_uri()]  # the file itself, nothing else
    page.head(3, 4)
    page.page.locator(".tok").nth(6).click()
    page.shown(3, 4, 6)
    expected = session.weights[3][0, 4, 6].double()
    torch.testing.assert_close(page.token_weights(), expected, atol=1e-6, rtol=0)
    page.head(3, "mean")
    page.shown(3, "mean", 6)
    expected = session.weights[3][0, :, 6].double().mean(0)
    torch.testing.assert_close(page.token_weights(), expected, atol=1e-6, rtol=0)
    assert not page.errors, page.errors
    page.close()


def test_an_8000_token_document(browser, tmp_path_factory):
    """A random-weight RoPE model (Llama, 2 layers, GQA) on 8,000 tokens: first paint and
    one row round trip, timed (the acceptance figures come from benchmarks/bench_view.py;
    the bounds here are generous for a shared CPU)."""
    folder = make_model_folder(tmp_path_factory.mktemp("llama"))
    session = text_session(document(8000), str(folder))
    assert session.length == 8000
    server = ViewServer(session)
    server.start()
    try:
        start = time.perf_counter()
        page = Page(browser, server.url)
        ready_s = time.perf_counter() - start
        assert page.page.locator(".tok").count() == 8000
        query = 4321
        page.head(1, 0)
        page.shown(1, 0, "")
        page.page.locator(".tok").nth(query).click()
        page.shown(1, 0, query)
        row_ms = float(page.page.get_attribute("body", "data-row-ms"))
        expected = session.weights[1][0, 0, query].double()
        got = page.token_weights()
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
        assert got[query + 1 :].abs().max() == 0  # causal: nothing after the query
        print(f"8000 tokens: page ready {ready_s:.2f} s, row round trip {row_ms:.0f} ms")
        assert ready_s < 20 and row_ms < 3000
        assert not page.errors, page.errors
        page.close()
    finally:
        server.stop()
