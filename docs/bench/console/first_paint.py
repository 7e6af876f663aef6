"""The console's first paint with many keys and a month of usage records (docs/console.md).

    PYTHONPATH=. .venv/bin/python docs/bench/console/first_paint.py [--keys 10000]
        [--records 100000] [--runs 5] [--cold] [--out docs/bench/console/first-paint.json]

Starts a nats-server (JetStream) and the bridge (`tokenbus serve bridge`, no workers), puts
``--keys`` keys in the key store the way `tokenbus keys create` does (KeyStore.create, each
audited) and ``--records`` usage records in TOKENBUS_USAGE (their times spread over the last
30 days, 10 per key by default), then opens the console in Debian's headless Chromium
(Selenium, as tests/test_console.py drives it), logs in with an admin key and loads the page
``--runs`` times with the session's cookie. Each load reports the browser's own timings:
first-contentful-paint (``performance.getEntriesByType('paint')``), the navigation timing
(response end, DOMContentLoaded, load), when the keys table showed its first 50 rows (a
MutationObserver added before the page's scripts), and the keys request's resource timing;
then the spend page over the last month (31 days, per day: the usage request and when its
table was drawn; the bridge keeps a slow summary ``CACHE_S`` seconds, so runs after the
first may be answered from it: ``--cold`` waits that out before each). Prints JSON (ms, the
median of the runs and each run, the load average) and writes it to ``--out``. Not a test:
nothing asserts on these times (STYLE.md, 11).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import nats

from auth.store import KeyStore
from bus_schemas import codec
from gateway.console_spend import CACHE_S
from telemetry import records
from tests.test_console import CHROMIUM, chromium
from tokenbus.launcher import free_port, nats_server_binary, port_open

MODELS = ("bench-small", "bench-large")
PER_MESSAGE = 200  # records per message, as a Recorder batches them
# Before the page's own scripts: when the keys table has a page of rows, when the spend
# table has any (CDP-injected, so the page's Content-Security-Policy does not apply).
OBSERVER = """
window.__tb = {};
new MutationObserver(() => {
  if (!window.__tb.keys && document.querySelectorAll('#keys-rows tr').length >= 50)
    window.__tb.keys = performance.now();
  if (window.__tb.spendFrom && !window.__tb.spend
      && document.querySelectorAll('#spend-rows tr').length > 0)
    window.__tb.spend = performance.now();
}).observe(document, {subtree: true, childList: true});
"""
TIMINGS = """
const nav = performance.getEntriesByType('navigation')[0];
const paint = Object.fromEntries(
  performance.getEntriesByType('paint').map(p => [p.name, p.startTime]));
const keys = performance.getEntriesByType('resource')
  .find(r => r.name.includes('/console/api/keys'));
return {
  first_contentful_paint_ms: paint['first-contentful-paint'] ?? null,
  first_paint_ms: paint['first-paint'] ?? null,
  response_end_ms: nav.responseEnd,
  dom_content_loaded_ms: nav.domContentLoadedEventEnd,
  load_ms: nav.loadEventEnd,
  keys_rows_shown_ms: window.__tb.keys ?? null,
  keys_request_ms: keys ? keys.duration : null,
  keys_response_bytes: keys ? keys.encodedBodySize : null,
};
"""


async def fill(url: str, n_keys: int, n_records: int) -> str:
    """``n_keys`` keys (and one admin key, returned) and ``n_records`` usage records."""
    nc = await nats.connect(url)
    store = await KeyStore(nc).open(watch=False)
    admin, _ = await store.create("bench-admin", admin=True)
    ids: list[str] = []
    for start in range(0, n_keys, 250):
        made = await asyncio.gather(
            *(
                store.create(f"bench-{i}", owner=f"team-{i % 100}", rpm=600)
                for i in range(start, min(n_keys, start + 250))
            )
        )
        ids += [rec.id for _, rec in made]
    js = nc.jetstream(timeout=10)
    await js.add_stream(records.stream_config())
    now_ns = time.time_ns()
    month_ns = 30 * 86400 * 10**9
    batch: list[dict[str, Any]] = []
    for i in range(n_records):
        ts = now_ns - (i * month_ns) // max(1, n_records)
        batch.append(
            records.build(
                request_id=uuid.uuid4().hex,
                source="http",
                model=MODELS[i % len(MODELS)],
                timings={"t0": ts},
                outcome="ok",
                principal=ids[i % len(ids)] if ids else None,
                prompt_tokens=100 + i % 900,
                completion_tokens=20 + i % 300,
            )
        )
        if len(batch) == PER_MESSAGE or i == n_records - 1:
            await js.publish(records.subject(), codec.encode({"records": batch}))
            batch = []
    await store.close()
    await nc.drain()
    return admin


def until(cond: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise SystemExit(f"{what}: not in {timeout} s")


def measure(base: str, admin: str, runs: int, cold: bool) -> list[dict[str, Any]]:
    from selenium.webdriver.common.by import By

    driver = chromium()
    try:
        driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": OBSERVER})
        driver.get(base + "/console")
        until(lambda: driver.find_element(By.ID, "login-key").is_displayed(), 30, "login form")
        driver.find_element(By.ID, "login-key").send_keys(admin)
        driver.find_element(By.CSS_SELECTOR, "#login-form button").click()
        until(lambda: driver.execute_script("return window.__tb.keys"), 60, "the keys page")
        out = []
        for i in range(runs):
            driver.get(f"{base}/console?run={i}")  # a fresh load, logged in by the cookie
            until(lambda: driver.execute_script("return window.__tb.keys"), 60, "keys rows")
            run = dict(driver.execute_script(TIMINGS))
            # The spend page over the month, per day: from the click to its table drawn.
            if cold:  # past the bridge's summaries cache: each run reads the stream again
                time.sleep(CACHE_S + 0.5)
            driver.execute_script(
                "document.getElementById('spend-since').value = '31d';"
                "document.getElementById('spend-bucket').value = 'day';"
                "window.__tb.spendFrom = performance.now();"
                "location.hash = 'spend';"
            )
            until(lambda: driver.execute_script("return window.__tb.spend"), 120, "spend rows")
            run |= driver.execute_script(
                "const u = performance.getEntriesByType('resource')"
                "  .filter(r => r.name.includes('/console/api/usage?since=31d')).pop();"
                "return {spend_month_shown_ms: window.__tb.spend - window.__tb.spendFrom,"
                " usage_request_ms: u ? u.duration : null,"
                " usage_queued_ms: u ? u.requestStart - u.startTime : null,"
                " usage_first_byte_ms: u ? u.responseStart - u.requestStart : null,"
                " usage_response_bytes: u ? u.encodedBodySize : null,"
                " spend_rows: document.querySelectorAll('#spend-rows tr').length};"
            )
            out.append({k: round(v, 1) if isinstance(v, float) else v for k, v in run.items()})
        return out
    finally:
        driver.quit()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default="docs/bench/console/first-paint.json")
    ap.add_argument(
        "--cold",
        action="store_true",
        help="wait out the bridge's summaries cache before each spend page: every run reads",
    )
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tokenbus-console-bench-"))
    port, http_port = free_port(), free_port()
    url = f"nats://127.0.0.1:{port}"
    server = subprocess.Popen(
        [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(tmp)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    bridge = None
    try:
        until(lambda: port_open("127.0.0.1", port), 30, "nats-server")
        t = time.monotonic()
        admin = asyncio.run(fill(url, args.keys, args.records))
        filled_s = round(time.monotonic() - t, 1)
        env = {
            **os.environ,
            "TOKENBUS_NATS_URL": url,
            "TOKENBUS_INGRESS__PIPELINE": '["auth", "route"]',
            "TOKENBUS_ROUTER__PRICE": '{"input": 1, "output": 2}',
        }
        log = (tmp / "bridge.log").open("wb")
        bridge = subprocess.Popen(
            [sys.executable, "-m", "tokenbus.cli", "serve", "bridge", "--port", str(http_port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        base = f"http://127.0.0.1:{http_port}"

        def ready() -> bool:
            try:
                with httpx.Client(base_url=base) as h:
                    h.post("/console/api/session", json={"key": admin}).raise_for_status()
                    total = h.get("/console/api/keys").json()["total"]
                    return bool(total >= args.keys)
            except httpx.HTTPError:
                return False

        until(ready, 120, "the bridge with every key")
        load_before = os.getloadavg()
        runs = measure(base, admin, args.runs, args.cold)
        keys = sorted(runs[0])
        median = {
            k: round(statistics.median(r[k] for r in runs), 1)
            for k in keys
            if all(isinstance(r[k], int | float) for r in runs)
        }
        result = {
            "keys": args.keys,
            "records": args.records,
            "fill_s": filled_s,
            "chromium": subprocess.run(
                [CHROMIUM, "--version"], capture_output=True, text=True, check=False
            ).stdout.strip(),
            "cpus": os.cpu_count(),
            "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
            "spend_cold": args.cold,
            "median": median,
            "runs": runs,
        }
        text = json.dumps(result, indent=2)
        print(text)
        Path(args.out).write_text(text + "\n")
    finally:
        for p in (bridge, server):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(20)


if __name__ == "__main__":
    main()
