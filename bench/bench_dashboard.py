"""How fast the dashboard's page is served and how much a first visit transfers.

Starts a local `exo` node with no model (or uses `--url`), then prints:
- `GET /` in ms: the first request after the API came up, then the median of `--runs`
  requests each on a new connection (cold: a first visit), on one kept-alive connection
  (warm: a reload), and revalidated with the ETag (the 304 a reload gets, `no-cache`);
- the page's total transferred size: the HTML and every file it loads (scripts, modules,
  styles, icons), in bytes, measured by loading `/` in headless Chromium (Debian's, through
  Playwright) and adding up each response's body and headers; the API data the page fetched
  while loading is counted apart. Without Chromium the files are found by reading the HTML
  and following the modules' `import`s instead (then headers are not counted).

Writes the figures as JSON (`--json`, default $TMPDIR/exo-bench-dashboard.json) and, with
`--screenshot PATH`, saves a picture of the page (1280x800).

Usage: python bench/bench_dashboard.py [--url http://127.0.0.1:52415] [--runs 20]
       [--screenshot docs/dashboard.png] [--view cluster]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpx

from exo.testing.processes import ExoNode

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ASSET_TYPES = {"document", "script", "stylesheet", "image", "font", "manifest", "other"}
# What a page's files reference: HTML src/href, CSS url(), JS module imports.
REFERENCE = re.compile(
    r"""(?:src|href)\s*=\s*["']([^"']+)["']"""
    r"""|url\(\s*["']?([^"')]+)["']?\s*\)"""
    r"""|(?:import|export)\s[^"';]*?from\s*["']([^"']+)["']"""
    r"""|import\s*\(?\s*["']([^"']+)["']"""
)


def milliseconds(start: float) -> float:
    return (time.perf_counter() - start) * 1000


def time_page(url: str, runs: int) -> dict[str, float]:
    """Times of `GET /` in ms (see the module docstring)."""
    start = time.perf_counter()
    first = httpx.get(f"{url}/", timeout=30)
    first.raise_for_status()
    first_ms = milliseconds(start)
    cold = []
    for _ in range(runs):
        with httpx.Client(timeout=30) as client:  # a new connection each time
            start = time.perf_counter()
            client.get(f"{url}/").raise_for_status()
            cold.append(milliseconds(start))
    warm, revalidated = [], []
    with httpx.Client(timeout=30) as client:
        etag = client.get(f"{url}/").headers.get("etag", "")
        for _ in range(runs):
            start = time.perf_counter()
            client.get(f"{url}/").raise_for_status()
            warm.append(milliseconds(start))
            start = time.perf_counter()
            response = client.get(f"{url}/", headers={"if-none-match": etag})
            revalidated.append(milliseconds(start))
            if response.status_code != 304:
                raise RuntimeError(f"revalidation answered {response.status_code}, not 304")
    return {
        "first_ms": first_ms,
        "cold_median_ms": statistics.median(cold),
        "warm_median_ms": statistics.median(warm),
        "revalidated_median_ms": statistics.median(revalidated),
        "html_bytes": len(first.content),
    }


def measure_in_chromium(url: str, view: str, screenshot: Path | None) -> dict[str, Any]:
    """Load the page in headless Chromium and add up what it transferred."""
    from playwright.sync_api import Request, sync_playwright

    assets: dict[str, int] = {}
    api: dict[str, int] = {}
    errors: list[str] = []

    def finished(request: Request) -> None:
        sizes = request.sizes()
        size = sizes["responseBodySize"] + sizes["responseHeadersSize"]
        path = urlsplit(request.url).path
        kind = request.resource_type
        if kind in ASSET_TYPES and not request.url.startswith("data:"):
            assets[path] = assets.get(path, 0) + size
        else:
            api[f"{kind} {path}"] = api.get(f"{kind} {path}", 0) + size

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.on("requestfinished", finished)
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda error: errors.append(str(error)))
            start = time.perf_counter()
            page.goto(f"{url}/#/{view}", wait_until="load")
            load_ms = milliseconds(start)
            page.wait_for_timeout(1500)  # the first data fetches and the first render
            if screenshot is not None:
                screenshot.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(screenshot))
        finally:
            browser.close()
    return {
        "method": "chromium",
        "load_event_ms": load_ms,
        "asset_count": len(assets),
        "asset_bytes": sum(assets.values()),
        "assets": dict(sorted(assets.items())),
        "api_bytes_while_loading": sum(api.values()),
        "api_requests": dict(sorted(api.items())),
        "console_errors": errors,
    }


def measure_by_parsing(url: str) -> dict[str, Any]:
    """The files the page references, found by reading them (no headers counted)."""
    assets: dict[str, int] = {}
    pending = [f"{url}/"]
    with httpx.Client(timeout=30) as client:
        while pending:
            address = pending.pop()
            path = urlsplit(address).path
            if path in assets:
                continue
            response = client.get(address)
            response.raise_for_status()
            assets[path] = len(response.content)
            if not re.search(r"html|javascript|css", response.headers.get("content-type", "")):
                continue
            for match in REFERENCE.finditer(response.text):
                reference = next(group for group in match.groups() if group)
                target = urljoin(address, reference)
                if target.startswith(url) and not reference.startswith(("data:", "#")):
                    pending.append(target.split("#")[0])
    return {
        "method": "parsed",
        "asset_count": len(assets),
        "asset_bytes": sum(assets.values()),
        "assets": dict(sorted(assets.items())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--url", help="use a running node instead of starting one")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--view", default="cluster", help="the page's view to load")
    parser.add_argument("--screenshot", type=Path, help="save a picture of the page here")
    parser.add_argument("--models-dir", type=Path, help="the started node's models directory")
    parser.add_argument(
        "--json", type=Path, default=Path(tempfile.gettempdir()) / "exo-bench-dashboard.json"
    )
    args = parser.parse_args()
    node = None
    url = args.url
    if url is None:
        home = Path(tempfile.mkdtemp(prefix="exo-bench-dashboard-"))
        node = ExoNode(home, models_dir=args.models_dir, extra_args=("--no-default-model",))
        node.start()
        url = node.url
    try:
        results: dict[str, Any] = {"url": url, "runs": args.runs, **time_page(url, args.runs)}
        if shutil.which(CHROMIUM):
            results["transfer"] = measure_in_chromium(url, args.view, args.screenshot)
        else:
            print(f"{CHROMIUM} is missing: sizes come from reading the page's files")
            results["transfer"] = measure_by_parsing(url)
    finally:
        if node is not None:
            node.stop()
    transfer = results["transfer"]
    print(f"GET / first request after start  {results['first_ms']:8.1f} ms")
    print(f"GET / cold (new connection)       {results['cold_median_ms']:8.2f} ms (median)")
    print(f"GET / warm (kept-alive)           {results['warm_median_ms']:8.2f} ms (median)")
    print(f"GET / revalidated (304)           {results['revalidated_median_ms']:8.2f} ms (median)")
    print(f"index.html                        {results['html_bytes']:8d} bytes")
    print(
        f"page total transferred            {transfer['asset_bytes']:8d} bytes in "
        f"{transfer['asset_count']} files ({transfer['method']})"
    )
    for path, size in transfer["assets"].items():
        print(f"  {path:<40} {size:8d}")
    if transfer["method"] == "chromium":
        print(f"load event                        {transfer['load_event_ms']:8.1f} ms")
        print(f"API data fetched while loading    {transfer['api_bytes_while_loading']:8d} bytes")
        if transfer["console_errors"]:
            print(f"console errors: {transfer['console_errors']}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
