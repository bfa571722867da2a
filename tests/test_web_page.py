"""The built-in page (server/static/) in a real headless browser: Debian's Chromium driven by
Playwright. It loads with no console errors, asks for the API key once (kept in the tab's session),
streams a chat answer from a tiny model with its stats, and its live view's numbers change after a
request. Screenshots go to $DFLASH_SCREENSHOTS when set (docs/web_*.png come from there)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest
from live_server import LiveServer

from dflash_core.settings import ModelSettings, ServerSettings, Settings

KEY = "page-test-key"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if not CHROMIUM and not os.environ.get("CI"):  # CI installs it (scripts/test.sh): there it must run
    pytest.skip("no chromium on this machine (apt-get install chromium)", allow_module_level=True)


@pytest.fixture(scope="module")
def server(qwen3_pair):
    settings = Settings(server=ServerSettings(api_key=KEY), prefix_cache_gb=0.05,
                        models=[ModelSettings(name="tiny", target=str(qwen3_pair[0]), drafter=str(qwen3_pair[1]))])
    with LiveServer(settings) as live:
        yield live


def _shot(page, name: str, tmp_path: Path) -> None:
    folder = Path(os.environ.get("DFLASH_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(folder / name), full_page=True)


def test_the_page_chats_and_shows_live_numbers(server, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    problems = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1200, "height": 800})
        page.on("console", lambda m: m.type == "error" and problems.append(m.text))
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.goto(server.url + "/")
        # The key, asked once: a wrong one is refused, the right one loads the models.
        expect(page.locator("#key-box")).to_be_visible()
        page.fill("#api-key", "wrong")
        page.click("#key-save")
        expect(page.locator("#key-error")).to_have_text("that key was refused")
        assert problems and all("401" in p for p in problems)  # that refusal, logged by the browser: on purpose
        problems.clear()
        page.fill("#api-key", KEY)
        page.click("#key-save")
        expect(page.locator("#model option")).to_have_text(["tiny"])
        expect(page.locator("#key-box")).to_be_hidden()
        page.reload()  # kept in the tab's session: not asked again
        expect(page.locator("#model option")).to_have_text(["tiny"])
        expect(page.locator("#key-box")).to_be_hidden()
        # A chat streams its answer, then its stats.
        page.fill("#max-tokens", "24")
        page.select_option("#speculation", "on")
        page.fill("#input", "Tell me about foxes.")
        page.click("#send")
        answer = page.locator(".message.assistant").last
        expect(answer.locator(".stats")).to_contain_text("tok/s", timeout=60000)
        expect(answer.locator(".stats")).to_contain_text("tokens/cycle")
        # What the API answers to the same request, reasoning shown apart from the answer (the
        # tiny Qwen3's template opens a reasoning block, so its greedy tokens are reasoning).
        same = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "tiny", "messages": [{"role": "user", "content": "Tell me about foxes."}],
                                "max_tokens": 24, "temperature": 0}, timeout=60).json()["choices"][0]["message"]
        assert same["reasoning_content"]
        assert answer.locator(".reasoning").text_content() == same["reasoning_content"]
        assert answer.locator(".content").text_content() == (same["content"] or "")
        _shot(page, "web_playground.png", tmp_path)
        # The live view counts it, and counts the next one.
        page.click("#tab-live")
        panel = page.locator(".model-live[data-model=tiny]")
        expect(panel.locator(".value-requests")).to_have_text("2")  # the page's chat and the API's
        assert int(panel.locator(".value-tokens").inner_text()) > 0
        reply = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                           json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                 "temperature": 0}, timeout=60)
        assert reply.status_code == 200
        expect(panel.locator(".value-requests")).to_have_text("3", timeout=10000)
        _shot(page, "web_live.png", tmp_path)
        browser.close()
    assert problems == []


def test_the_live_numbers_are_the_requests(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    before = httpx.get(server.url + "/v1/dflash/live", headers=auth).json()["models"].get("tiny", {"requests": 0})
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0,
            "dflash": {"speculation": "on"}}
    reply = httpx.post(server.url + "/v1/chat/completions", headers=auth, json=body, timeout=60).json()
    live = httpx.get(server.url + "/v1/dflash/live", headers=auth).json()
    tiny = live["models"]["tiny"]
    assert tiny["requests"] == before["requests"] + 1
    assert tiny["generated_tokens"] >= reply["usage"]["completion_tokens"]
    assert sum(tiny["tokens_per_second"]) * tiny["bucket_seconds"] >= reply["dflash"]["generated_tokens"]
    assert len(tiny["acceptance_by_position"]) == 15 and tiny["tokens_per_cycle"] >= 1
    assert live["active_requests"] == 0 and live["memory"]["prefix_cache_budget_bytes"] == int(0.05e9)
    # The key guards the numbers as it guards the API; the page itself is open.
    assert httpx.get(server.url + "/v1/dflash/live").status_code == 401
    assert httpx.get(server.url + "/").status_code == 200
    assert httpx.get(server.url + "/page/config").json() == {"api_key_required": True}


def test_without_a_key_the_page_asks_for_none(qwen3_pair):
    from playwright.sync_api import expect, sync_playwright

    settings = Settings(models=[ModelSettings(name="tiny", target=str(qwen3_pair[0]), drafter=str(qwen3_pair[1]))])
    problems = []
    with LiveServer(settings) as live, sync_playwright() as p:
        assert httpx.get(live.url + "/page/config").json() == {"api_key_required": False}
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page()
        page.on("console", lambda m: m.type == "error" and problems.append(m.text))
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.goto(live.url + "/")
        expect(page.locator("#model option")).to_have_text(["tiny"])
        expect(page.locator("#key-box")).to_be_hidden()
        page.click("#tab-live")
        expect(page.locator("#live-models")).to_have_text("No generation has finished yet.")
        browser.close()
    assert problems == []
