"""The operator console in a real browser (headless Chromium under Selenium): the pages a
user clicks through, against tests/test_console.py's stack (its fixtures: a stack of this
file's own). Apart from the console's HTTP tests so that neither file takes over 90 s of a
worker's time (docs/testing.md)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import nats
import pytest

from router.expert import train
from tests.support.repo import ROOT
from tests.support.waits import wait_for
from tests.test_console import (
    CHROMEDRIVER,
    CHROMIUM,
    Env,
    Lora,
    bus,
    csrf,
    env,
    login,
    lora,
    owners_keys,
    slow_response,
)

# The module-scoped fixtures, one stack for this file.
__all__ = ["bus", "env", "lora"]


# -- the browser ---------------------------------------------------------------------------
def chromium() -> Any:
    """Headless Chromium under Selenium, or skip where either is missing (also the browser
    of docs/bench/console/first_paint.py)."""
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.skip("Debian's chromium and chromium-driver are not installed")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed (the dev extra has it)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,900"):
        opts.add_argument(arg)
    opts.add_argument("--disable-dev-shm-usage")
    return webdriver.Chrome(options=opts, service=Service(CHROMEDRIVER))


def _alert(driver: Any) -> bool:
    """Whether a dialog (the revoke confirmation) is open."""
    from selenium.common.exceptions import NoAlertPresentException

    try:
        driver.switch_to.alert.text  # noqa: B018 - raises while no dialog is open
    except NoAlertPresentException:
        return False
    return True


async def click_shown(driver: Any, css: str, what: str) -> None:
    """Click the element once it is displayed; again if the live feed redrew its table
    between finding and clicking it (the element found is then gone)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    def clicked() -> bool:
        try:
            found = driver.find_elements(By.CSS_SELECTOR, css)
            if not found or not found[0].is_displayed():
                return False
            found[0].click()
        except StaleElementReferenceException:
            return False
        return True

    await wait_for(clicked, what=what)


@pytest.mark.stack
async def test_in_chromium_log_in_create_use_see_and_revoke_a_key(env: Env, tmp_path: Path) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver = chromium()
    shots = tmp_path / "screenshots"
    shots.mkdir()

    def shown(css: str) -> Any:
        """The element, when displayed (the live feed may redraw a table meanwhile)."""
        try:
            found = driver.find_elements(By.CSS_SELECTOR, css)
            return found[0] if found and found[0].is_displayed() else None
        except StaleElementReferenceException:
            return None

    def text(css: str) -> str:
        try:
            found = driver.find_elements(By.CSS_SELECTOR, css)
            return str(found[0].text) if found else ""
        except StaleElementReferenceException:
            return ""

    try:
        driver.get(env.stack.base + "/console")
        await wait_for(lambda: shown("#login-key"), timeout=20, what="the login form")
        driver.find_element(By.ID, "login-key").send_keys(env.admin)
        driver.find_element(By.CSS_SELECTOR, "#login-form button").click()
        await wait_for(lambda: shown("#page-keys"), timeout=20, what="the keys page")
        # The key is in no storage the page can read.
        stored = driver.execute_script(
            "return JSON.stringify(localStorage) + JSON.stringify(sessionStorage) + "
            "document.cookie + document.getElementById('login-key').value"
        )
        assert env.admin not in stored and "tb_console" not in stored
        form = driver.find_element(By.ID, "key-form")
        form.find_element(By.NAME, "name").send_keys("browser-made")
        form.find_element(By.NAME, "owner").send_keys("team-browser")
        form.find_element(By.NAME, "rpm").send_keys("600")
        form.find_element(By.NAME, "budget_usd").send_keys("25")
        form.find_element(By.ID, "key-submit").click()
        await wait_for(lambda: shown("#secret"), timeout=20, what="the new key's secret")
        secret = driver.find_element(By.ID, "secret-value").text.strip()
        assert secret.startswith("tb-")
        key_id = secret[3:15]
        driver.save_screenshot(str(shots / "keys.png"))
        driver.find_element(By.ID, "secret-done").click()
        # Its owner's budget, set through the owner budget form.
        budget = driver.find_element(By.ID, "owner-budget-form")
        budget.find_element(By.NAME, "owner").send_keys("team-browser")
        budget.find_element(By.NAME, "budget_usd").send_keys("40")
        budget.find_element(By.ID, "owner-budget-submit").click()
        await wait_for(
            lambda: "team-browser: $40 per month" in text("#owner-budget-note"),
            what="the owner's budget saved",
        )
        # The key works with the openai SDK.
        reply = await env.stack.openai(secret).chat.completions.create(
            model=env.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert reply.choices[0].message.content
        # Listed (search by name) with its limits.
        q = driver.find_element(By.ID, "keys-q")
        q.send_keys("browser-made")
        row = f"tr[data-key='{key_id}']"
        await wait_for(lambda: shown(row), timeout=20, what="the new key in the list")
        await wait_for(lambda: "600 rpm" in text(row), what="the key's limits listed")
        # Its spend appears on the spend page.
        driver.find_element(By.CSS_SELECTOR, "nav a[data-page='spend']").click()
        spend_row = f"#spend-rows tr[data-key='{key_id}']"

        def spend_shown() -> Any:
            if shown(spend_row):
                return True
            driver.find_element(By.ID, "spend-refresh").click()
            return False

        await wait_for(spend_shown, timeout=30, interval=0.5, what="the key's spend")
        await wait_for(
            lambda: driver.find_elements(By.CSS_SELECTOR, "#spend-chart svg rect"),
            what="the spend chart",
        )
        # That key alone, against its $25 budget: the hard budget's line and the running total.
        box = driver.find_element(By.ID, "spend-key")
        box.send_keys(key_id)
        box.send_keys("\n")
        driver.find_element(By.ID, "spend-refresh").click()
        await wait_for(
            lambda: (
                driver.find_elements(By.CSS_SELECTOR, "#spend-chart line[data-budget='hard']")
                and driver.find_elements(By.CSS_SELECTOR, "#spend-chart polyline[data-running]")
            ),
            what="the key's budget line",
        )
        assert "hard budget $25 per month" in text("#spend-budget")
        driver.save_screenshot(str(shots / "spend.png"))
        driver.find_element(By.CSS_SELECTOR, "nav a[data-page='replicas']").click()
        await wait_for(
            lambda: shown(f"#replicas-rows tr[data-replica='{env.model}-0']"),
            what="a replica on the replicas page",
        )
        rep = f"#replicas-rows tr[data-replica='{env.model}-0']"
        # No adapter loaded at run time; the KV check's totals (the feed redraws the rows).
        await wait_for(lambda: text(f"{rep} td.adapters") == "—", what="no adapters shown")
        await wait_for(lambda: " / " in text(f"{rep} td.kv-check"), what="the KV check shown")
        # A model's routing changed through the form, listed, then reset from its row.
        routing = driver.find_element(By.ID, "routing-form")
        routing.find_element(By.NAME, "model").send_keys(env.model)
        Select(routing.find_element(By.NAME, "policy")).select_by_visible_text("round_robin")
        routing.find_element(By.ID, "routing-submit").click()
        changed = f"#routing-rows tr[data-model='{env.model}']"
        await wait_for(lambda: "round_robin" in text(changed), what="the model's routing listed")
        assert "round_robin" in text("#status")
        driver.execute_script("window.scrollTo(0, 0)")  # the page's top: replicas, adapters
        driver.save_screenshot(str(shots / "replicas.png"))
        await click_shown(driver, f"{changed} button.danger", "the routing's Reset")
        await wait_for(lambda: not shown(changed), what="the model's routing reset")
        # An unknown model's alias: the admin API's refusal, in the status region.
        aliases = driver.find_element(By.ID, "alias-form")
        aliases.find_element(By.NAME, "name").send_keys(env.model)
        aliases.find_element(By.NAME, "model").send_keys("no-such-model")
        aliases.find_element(By.ID, "alias-submit").click()
        await wait_for(lambda: "may not hide it" in text("#status.error"), what="the alias refused")
        driver.find_element(By.CSS_SELECTOR, "nav a[data-page='audit']").click()
        await wait_for(lambda: shown("#audit-rows tr"), what="the audit events")
        driver.save_screenshot(str(shots / "audit.png"))
        # The bus: the stack's nats-server up, the URL nothing answers down, the audit stream.
        driver.find_element(By.CSS_SELECTOR, "nav a[data-page='bus']").click()
        up, down = (f"#bus-servers tr[data-server='{u}']" for u in (env.bus.monitor, env.bus.dead))
        await wait_for(lambda: "console-node" in text(up), what="the server on the bus page")
        assert "up" in text(up).split()
        # The dead URL's row comes once its probe has given up (CI run bc read it before).
        await wait_for(lambda: "down" in text(down).split(), what="the dead server as down")
        await wait_for(
            lambda: shown("#bus-streams tr[data-stream='TOKENBUS_AUDIT']"), what="the streams"
        )
        assert "TokenbusNATSServerDown" in text("#bus-alerts")
        driver.save_screenshot(str(shots / "bus.png"))
        # Revoke it from the keys page (the confirmation accepted).
        driver.find_element(By.CSS_SELECTOR, "nav a[data-page='keys']").click()
        await wait_for(lambda: shown(row), what="the key listed again")
        await click_shown(driver, f"{row} button.danger", "the revoke button")
        await wait_for(lambda: _alert(driver), what="the confirmation")
        driver.switch_to.alert.accept()
        await wait_for(lambda: "revoked" in text(row), what="the key shown revoked")
        driver.save_screenshot(str(shots / "console.png"))

        async def refused() -> bool:
            async with env.stack.http("/v1") as h:
                r = await h.get("/models", headers={"Authorization": f"Bearer {secret}"})
                return r.status_code == 401

        await wait_for(refused, timeout=10, what="the revoked key refused")
        # Logging out shows the login form again.
        driver.find_element(By.ID, "logout").click()
        await wait_for(lambda: shown("#login-key"), what="the login form after logout")
        if os.environ.get("TOKENBUS_DOCS_SCREENSHOTS"):  # docs/console.md: refresh its pictures
            shutil.copyfile(shots / "console.png", ROOT / "docs" / "console.png")
            for page in ("keys", "spend", "replicas", "audit", "bus"):
                shutil.copyfile(shots / f"{page}.png", ROOT / "docs" / "console" / f"{page}.png")
    finally:
        driver.quit()


class Browser:
    """Headless Chromium on the console, logged in, with the waits the pages need (the live
    feed may redraw a table while it is read)."""

    def __init__(self, env: Env) -> None:
        from selenium.webdriver.common.by import By

        self.by = By
        self.env = env
        self.driver = chromium()

    async def open(self, page: str, key: str) -> None:
        self.driver.get(self.env.stack.base + "/console")
        await wait_for(lambda: self.shown("#login-key"), timeout=20, what="the login form")
        self.driver.find_element(self.by.ID, "login-key").send_keys(key)
        self.driver.find_element(self.by.CSS_SELECTOR, "#login-form button").click()
        await wait_for(lambda: self.shown("#page-keys"), timeout=20, what="the keys page")
        if page != "keys":
            self.driver.find_element(self.by.CSS_SELECTOR, f"nav a[data-page='{page}']").click()
            await wait_for(lambda: self.shown(f"#page-{page}"), what=f"the {page} page")

    def shown(self, css: str) -> Any:
        from selenium.common.exceptions import StaleElementReferenceException

        try:
            found = self.driver.find_elements(self.by.CSS_SELECTOR, css)
            return found[0] if found and found[0].is_displayed() else None
        except StaleElementReferenceException:
            return None

    def text(self, css: str) -> str:
        from selenium.common.exceptions import StaleElementReferenceException

        try:
            found = self.driver.find_elements(self.by.CSS_SELECTOR, css)
            return str(found[0].text) if found else ""
        except StaleElementReferenceException:
            return ""

    def fill(self, form: str, values: dict[str, str]) -> None:
        """Type ``values`` into the fields of ``form`` by name (selects by visible text)."""
        from selenium.webdriver.support.ui import Select

        f = self.driver.find_element(self.by.ID, form)
        for name, value in values.items():
            field = f.find_element(self.by.NAME, name)
            if field.tag_name == "select":
                Select(field).select_by_visible_text(value)
            else:
                field.clear()
                field.send_keys(value)

    def value(self, form: str, name: str) -> str:
        f = self.driver.find_element(self.by.ID, form)
        return str(f.find_element(self.by.NAME, name).get_attribute("value"))

    async def click(self, css: str, what: str) -> None:
        await click_shown(self.driver, css, what)

    async def confirm(self) -> None:
        await wait_for(lambda: _alert(self.driver), what="the confirmation")
        self.driver.switch_to.alert.accept()


@pytest.mark.stack
async def test_in_chromium_the_routing_form_sets_tiered_latency_kv_and_expert_routing(
    env: Env, tmp_path: Path
) -> None:
    model = f"routed-{uuid.uuid4().hex[:8]}"  # a model's routing may change before it is served
    expert_dir = tmp_path / "expert"
    train(ROOT / "tests" / "data" / "prompts.jsonl", 6, expert_dir)
    adm = {"api-key": env.admin}
    b = Browser(env)
    async with env.stack.http("/v1/admin/routing") as h:

        async def change() -> Any:
            r = await h.get(f"/{model}", headers=adm)
            assert r.status_code == 200, r.text
            return r.json()["override"]

        try:
            await b.open("replicas", env.admin)
            b.fill("routing-form", {
                "model": model, "policy": "predicted_latency", "pool_policy": "concurrency_tiered",
                "load_bound": "1.5", "prefix_block_chars": "64",
                "tiered.threshold": "32", "tiered.hysteresis": "4",
                "tiered.high_pool": "tp8", "tiered.wide_pool": "tp2",
                "kv.prefix_weight": "2", "kv.load_weight": "0.5", "kv.queue_weight": "0.25",
                "kv.work_weight": "3",
                "latency_targets": '{"priority": {"ttft_ms": 250, "tpot_ms": 20}}',
            })  # fmt: skip
            b.driver.find_element(b.by.ID, "routing-submit").click()
            row = f"#routing-rows tr[data-model='{model}']"
            await wait_for(lambda: "concurrency_tiered" in b.text(row), what="the change listed")
            want = {
                "policy": "predicted_latency",
                "pool_policy": "concurrency_tiered",
                "load_bound": 1.5,
                "prefix_block_chars": 64,
                "tiered": {
                    "threshold": 32,
                    "hysteresis": 4,
                    "high_pool": "tp8",
                    "wide_pool": "tp2",
                },
                "kv": {
                    "prefix_weight": 2,
                    "load_weight": 0.5,
                    "queue_weight": 0.25,
                    "work_weight": 3,
                },
                "latency_targets": {"priority": {"ttft_ms": 250, "tpot_ms": 20}},
            }
            assert await change() == want
            routing = (await h.get(f"/{model}", headers=adm)).json()["routing"]
            assert routing["tiered"]["threshold"] == 32 and routing["kv"]["load_weight"] == 0.5
            # The classes it does not name keep the configuration's targets.
            assert routing["latency_targets"]["default"] == {"ttft_ms": 2000, "tpot_ms": 100}
            # A JSON field that is not the object it must be: said in the page, nothing sent.
            b.fill("routing-form", {"expert.targets": '["pool:wide"]'})
            b.driver.find_element(b.by.ID, "routing-submit").click()
            await wait_for(
                lambda: "expert.targets: a JSON object" in b.text("#status.error"),
                what="the targets refused in the page",
            )
            assert await change() == want
            # An expert folder the routers cannot read: the admin API's refusal, as it comes.
            nowhere = str(tmp_path / "nowhere")
            b.fill("routing-form", {"pool_policy": "expert", "expert.model_dir": nowhere,
                                    "expert.targets": '{"0": "pool:tp2"}'})  # fmt: skip
            b.driver.find_element(b.by.ID, "routing-submit").click()
            body = {"pool_policy": "expert", "expert": {"model_dir": nowhere}}
            refusal = (await h.put(f"/{model}", json=body, headers=adm)).json()["error"]
            assert refusal["param"] == "expert.model_dir", refusal
            await wait_for(
                lambda: b.text("#status.error") == refusal["message"], what="the refusal shown"
            )
            assert await change() == want
            # Edit fills the form with the change; then the expert pool with its targets.
            await b.click(f"{row} button.edit", "the row's Edit")
            assert b.value("routing-form", "tiered.threshold") == "32"
            assert json.loads(b.value("routing-form", "latency_targets")) == want["latency_targets"]
            assert b.value("routing-form", "expert.model_dir") == ""
            targets = '{"0": "pool:tp2", "code": "coder"}'
            b.fill("routing-form", {"pool_policy": "expert", "expert.model_dir": str(expert_dir),
                                    "expert.targets": targets})  # fmt: skip
            b.driver.find_element(b.by.ID, "routing-submit").click()
            await wait_for(lambda: "expert" in b.text(f"{row} td:nth-child(3)"), what="expert")
            expert = {"model_dir": str(expert_dir), "targets": {"0": "pool:tp2", "code": "coder"}}
            assert await change() == {**want, "pool_policy": "expert", "expert": expert}
            b.driver.save_screenshot(str(tmp_path / "routing.png"))
            await b.click(f"{row} button.danger", "the row's Reset")
            await wait_for(lambda: not b.shown(row), what="the change reset")
            assert await change() is None
        finally:
            b.driver.quit()
            await h.delete(f"/{model}", headers=adm)


@pytest.mark.stack
async def test_in_chromium_an_adapter_is_loaded_and_unloaded(
    env: Env, lora: Lora, tmp_path: Path
) -> None:
    name = f"sql-{uuid.uuid4().hex[:6]}"
    adm = {"api-key": env.admin}
    b = Browser(env)
    async with env.stack.http() as h:

        async def admin_rows() -> dict[str, Any]:
            r = await h.get("/v1/admin/adapters", headers=adm)
            return {a["name"]: a for a in r.json()["adapters"]}

        try:
            await b.open("replicas", env.admin)
            await wait_for(lambda: "No adapter" in b.text("#adapter-rows"), what="none loaded")
            b.fill("adapter-form", {"name": name, "model": lora.model, "path": lora.path})
            b.driver.find_element(b.by.ID, "adapter-submit").click()
            row = f"#adapter-rows tr[data-adapter='{name}']"
            await wait_for(lambda: lora.replica in b.text(f"{row} td.loaded-on"), what="loaded")
            assert f"is loaded on {lora.replica}" in b.text("#status")
            assert (await admin_rows())[name]["loaded_on"] == [lora.replica]
            # The replica's own row says so too (its heartbeats, through the live feed).
            adapters = f"#replicas-rows tr[data-replica='{lora.replica}'] td.adapters"
            await wait_for(lambda: b.text(adapters) == name, what="the adapter on its replica")
            b.driver.save_screenshot(str(tmp_path / "adapters.png"))
            # A second load of a folder the sim refuses (rank above its max): said as it comes.
            big = tmp_path / "big"
            big.mkdir()
            (big / "adapter_config.json").write_text(json.dumps({"r": 64}))
            b.fill("adapter-form", {"name": f"big-{name}", "path": str(big)})
            b.driver.find_element(b.by.ID, "adapter-submit").click()
            await wait_for(lambda: "max_lora_rank" in b.text("#status.error"), what="refused")
            assert f"big-{name}" not in await admin_rows()
            # Unloaded from its row (the confirmation accepted), at once (no drain).
            b.fill("adapter-form", {"drain_s": "0"})
            await b.click(f"{row} button.danger", "the adapter's Unload")
            await b.confirm()
            await wait_for(lambda: not b.shown(row), what="the adapter gone from the table")
            assert name not in await admin_rows()
            await wait_for(lambda: b.text(adapters) == "—", what="none on its replica")
        finally:
            b.driver.quit()
            if name in await admin_rows():
                await h.delete(f"/v1/admin/adapters/{name}?drain_s=0", headers=adm)


@pytest.mark.stack
async def test_in_chromium_the_owners_with_a_budget_are_listed_edited_and_removed(
    env: Env,
) -> None:
    owner = f"listed-{uuid.uuid4().hex[:6]}"
    adm = {"api-key": env.admin}
    path = f"/v1/admin/keys/owners/{owner}/budget"
    b = Browser(env)
    async with env.stack.http() as h:
        r = await h.put(path, json={"budget_usd": 40, "period": "month"}, headers=adm)
        assert r.status_code == 200, r.text
        try:
            await b.open("keys", env.admin)
            row = f"#owner-budget-rows tr[data-owner='{owner}']"
            await wait_for(lambda: "$40 / month" in b.text(row), what="the owner listed")
            await b.click(f"{row} button.edit", "the owner's Edit")
            assert b.value("owner-budget-form", "owner") == owner
            assert b.value("owner-budget-form", "budget_usd") == "40"
            b.fill("owner-budget-form", {"budget_usd": "55", "soft_budget_usd": "50",
                                         "period": "day"})  # fmt: skip
            b.driver.find_element(b.by.ID, "owner-budget-submit").click()
            await wait_for(lambda: "$55, soft $50 / day" in b.text(row), what="the edit listed")
            got = (await h.get(path, headers=adm)).json()
            assert (got["budget_usd"], got["soft_budget_usd"], got["period"]) == (55, 50, "day")
            await b.click(f"{row} button.danger", "the owner's Remove")
            await b.confirm()
            await wait_for(lambda: not b.shown(row), what="the owner gone from the list")
            assert (await h.get(path, headers=adm)).json()["budget_usd"] is None
        finally:
            b.driver.quit()


@pytest.mark.stack
async def test_in_chromium_spend_by_owner_shows_the_owners_row_and_its_budget_lines(
    env: Env,
) -> None:
    owner = f"drawn-{uuid.uuid4().hex[:6]}"
    b = Browser(env)
    async with env.stack.http() as h:
        me = await login(h, env.admin)
        await owners_keys(env, h, me, [owner, owner])
        budget = {"budget_usd": 30, "soft_budget_usd": 20, "period": "month"}
        r = await h.put(f"/console/api/owners/{owner}/budget", json=budget, headers=csrf(me))
        assert r.status_code == 200, r.text
    from selenium.webdriver.support.ui import Select

    try:
        await b.open("spend", env.admin)
        Select(b.driver.find_element(b.by.ID, "spend-group")).select_by_value("owner")
        row = f"#spend-rows tr[data-owner='{owner}']"

        def listed() -> bool:
            if b.shown(row):
                return True
            b.driver.find_element(b.by.ID, "spend-refresh").click()
            return False

        await wait_for(listed, timeout=30, interval=0.5, what="the owner's row")
        assert b.text(row).split()[:2] == [owner, "2"]  # its two keys
        # That owner alone: its series, its hard and soft budget lines and running total.
        box = b.shown("#spend-owner")
        assert box is not None
        box.send_keys(owner + "\n")
        b.driver.find_element(b.by.ID, "spend-refresh").click()
        await wait_for(
            lambda: all(
                b.driver.find_elements(b.by.CSS_SELECTOR, f"#spend-chart {css}")
                for css in (
                    "line[data-budget='hard']",
                    "line[data-budget='soft']",
                    "polyline[data-running]",
                )
            ),
            what="the owner's budget lines",
        )
        note = b.text("#spend-budget")
        assert f"Owner {owner}" in note and "hard budget $30 per month" in note, note
        assert "soft budget $20 per month" in note
        assert b.text(f"#spend-chart text[data-legend='o:{owner}']") == owner
    finally:
        b.driver.quit()


@pytest.mark.stack
async def test_in_chromium_jobs_list_background_responses_and_replicas_their_host(
    env: Env, tmp_path: Path
) -> None:
    import socket

    slow = await slow_response(env)
    b = Browser(env)
    driver, by = b.driver, b.by
    try:
        await b.open("replicas", env.admin)
        # The replicas name their host.
        rep = f"#replicas-rows tr[data-replica='{env.model}-0'] td.host"
        await wait_for(lambda: b.text(rep) == socket.gethostname(), what="the replica's host")
        # The jobs page lists the running background response with its progress, and its
        # Cancel button cancels it.
        driver.find_element(by.CSS_SELECTOR, "nav a[data-page='jobs']").click()
        row = f"#responses-rows tr[data-response='{slow}']"

        def running() -> bool:
            if "events so far" in b.text(f"{row} td.progress"):
                return True
            driver.find_element(by.ID, "responses-refresh").click()
            return False

        await wait_for(running, timeout=30, interval=0.5, what="the response running, listed")
        assert b.text(f"{row} td.status") == "in_progress"
        assert env.plain_id in b.text(row) and env.model in b.text(row)
        driver.save_screenshot(str(tmp_path / "jobs.png"))
        await b.click(f"{row} button.danger", "the response's Cancel")

        def cancelled() -> bool:
            if b.text(f"{row} td.status") == "cancelled":
                return True
            driver.find_element(by.ID, "responses-refresh").click()
            return False

        await wait_for(cancelled, timeout=30, interval=0.5, what="the response shown cancelled")
        assert "cancelled" in b.text("#status")
        assert not driver.find_elements(by.CSS_SELECTOR, f"{row} button.danger")
        if os.environ.get("TOKENBUS_DOCS_SCREENSHOTS"):  # docs/console.md's picture of it
            shutil.copyfile(tmp_path / "jobs.png", ROOT / "docs" / "console" / "jobs.png")
    finally:
        driver.quit()


@pytest.mark.stack
async def test_in_chromium_the_bus_page_updates_by_itself(env: Env) -> None:
    name = f"CONSOLE_LIVE_{uuid.uuid4().hex[:8].upper()}"
    nc = await nats.connect(env.bus.url)
    js = nc.jetstream()
    b = Browser(env)
    try:
        await b.open("bus", env.admin)
        await wait_for(
            lambda: b.shown("#bus-streams tr[data-stream='KV_tokenbus_keys']"), what="the streams"
        )
        await wait_for(lambda: b.text("#bus-updated").startswith("updated"), what="its time")
        badge = b.driver.find_element(b.by.CSS_SELECTOR, "#bus-title .live")
        await wait_for(lambda: "off" not in str(badge.get_attribute("class")), what="live on")
        # A stream made on the bus appears with no Refresh pressed, and so do its messages.
        await js.add_stream(name=name, subjects=[f"consolelive.{name}"])
        row = f"#bus-streams tr[data-stream='{name}']"
        await wait_for(lambda: b.shown(row), timeout=30, what="the new stream shown by itself")
        at = b.driver.find_element(b.by.ID, "bus-updated").get_attribute("data-at")
        await js.publish(f"consolelive.{name}", b"m")
        await wait_for(
            lambda: b.text(f"{row} td:nth-child(2)") == "1", timeout=30, what="its message shown"
        )
        now = b.driver.find_element(b.by.ID, "bus-updated").get_attribute("data-at")
        assert int(now) > int(at), (at, now)
    finally:
        b.driver.quit()
        with contextlib.suppress(Exception):
            await js.delete_stream(name)
        await nc.close()


@pytest.mark.stack
async def test_in_chromium_a_key_gets_its_own_aliases_and_body_bound_from_the_form(
    env: Env,
) -> None:
    """The key form takes the two options of `tokenbus keys create` it lacked: the key's own
    model aliases (NAME=MODEL; one without `=` refused in the page, nothing sent) and its
    bound on large request bodies held at once; Edit shows them again."""
    name = f"aliased-{uuid.uuid4().hex[:6]}"
    adm = {"api-key": env.admin}
    b = Browser(env)
    try:
        await b.open("keys", env.admin)
        b.fill("key-form", {"name": name, "aliases": "nope"})
        b.driver.find_element(b.by.ID, "key-submit").click()
        await wait_for(lambda: "NAME=MODEL" in b.text("#status"), what="the bad alias refused")
        b.fill("key-form", {"aliases": f"fast={env.model}", "max_body_bytes": "1048576"})
        b.driver.find_element(b.by.ID, "key-submit").click()
        await wait_for(lambda: "created" in b.text("#status"), what="the key created")
        key_id = b.text("#status").split()[1]
        async with env.stack.http() as h:
            got = (await h.get(f"/v1/admin/keys/{key_id}", headers=adm)).json()
            listed = (await h.get("/v1/admin/keys", headers=adm)).json()["data"]
        assert got["name"] == name and got["aliases"] == {"fast": env.model}, got
        assert got["max_body_bytes"] == 1048576, got
        assert sum(k["name"] == name for k in listed) == 1  # the refused one never went
        b.driver.find_element(b.by.ID, "secret-done").click()
        await b.click(f"tr[data-key='{key_id}'] button[aria-label='Edit key {key_id}']", "Edit")
        assert b.value("key-form", "aliases") == f"fast={env.model}"
        assert b.value("key-form", "max_body_bytes") == "1048576"
    finally:
        b.driver.quit()
