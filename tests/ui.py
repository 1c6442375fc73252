"""The Prefect UI in headless Chromium (Playwright driving Debian's /usr/bin/chromium): screenshots of
the deployment's parameter form and of a flow run's attempts table, with the text each page showed."""

from __future__ import annotations

import base64
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

CHROMIUM = os.environ.get("SPOTRUN_CHROMIUM", "/usr/bin/chromium")
VIEWPORT = {"width": 1700, "height": 1000}  # wide enough for all columns of the attempts table


def chromium_missing() -> str | None:
    """Why the UI check cannot run here, or None when it can."""
    if shutil.which(CHROMIUM) is None:
        return f"no Chromium at {CHROMIUM}: `make test` installs Debian's chromium package (apt, as root)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed: `make test` installs the dev extras"
    return None


@dataclass(frozen=True)
class Shot:
    png: Path
    text: str  # the page's visible text, for assertions
    image_loaded: bool = False  # an <img> on the page was decoded (naturalWidth > 0)


def screenshots(
    ui_url: str, deployment_id: str, flow_run_id: str, out: Path, *, auth: str | None = None
) -> dict[str, Shot]:
    """The deployment's run form (and its provider's form), the flow run's Artifacts tab, its attempts
    table and the summary's timeline image. `auth`: the server's auth string, given to the UI as its
    login page would store it (base64, localStorage `prefect-password`)."""
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    shots: dict[str, Shot] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport=VIEWPORT)  # type: ignore[arg-type]
            if auth is not None:
                token = base64.b64encode(auth.encode()).decode()
                page.add_init_script(f"localStorage.setItem('prefect-password', {json.dumps(token)})")

            def shoot(name: str, full_page: bool = False) -> None:
                page.wait_for_load_state("networkidle")
                png = out / f"{name}.png"
                page.screenshot(path=str(png), full_page=full_page)
                shots[name] = Shot(png, page.inner_text("body"))

            page.goto(f"{ui_url}/deployments/deployment/{deployment_id}/run")
            page.get_by_text("Total Steps", exact=True).wait_for()
            shoot("deployment-form")
            page.get_by_text("Heartbeat Timeout S", exact=False).first.scroll_into_view_if_needed()
            shoot("provider-choice")
            page.goto(f"{ui_url}/runs/flow-run/{flow_run_id}")
            page.get_by_text("Artifacts", exact=True).first.click()
            page.get_by_text("attempts of", exact=False).first.wait_for()
            shoot("flow-run-artifacts")
            page.get_by_text("attempts of", exact=False).first.click()  # the newest version first
            page.get_by_text("lost steps", exact=True).first.wait_for()
            shoot("attempts-table", full_page=True)
            page.goto(f"{ui_url}/runs/flow-run/{flow_run_id}")
            page.get_by_text("Artifacts", exact=True).first.click()
            page.get_by_text("run summary of", exact=False).first.click()
            image = page.locator("img[alt='training step over wall time']").first
            image.wait_for()
            image.scroll_into_view_if_needed()
            shoot("timeline")
            loaded = image.evaluate("i => i.complete && i.naturalWidth > 0")
            shots["timeline"] = Shot(shots["timeline"].png, shots["timeline"].text, bool(loaded))
        finally:
            browser.close()
    return shots
