#!/usr/bin/env python3
"""The dashboard in headless Chromium, as a person would use it.

    check.py BASE_URL SCREENSHOT_PATH [--vm ID] [--api-key KEY] [--list-only]

Drives Debian's chromium (/usr/bin/chromium) through Debian's chromedriver
(/usr/bin/chromedriver) with Selenium (tests/dashboard/install.sh installs
all three; Selenium Manager never runs). Against a sproutd at BASE_URL that
has sandboxes of the test guest (service/tests/dashboard.rs makes them):

- /dashboard lists every sandbox the API lists, with its state, shape and
  metadata (as text: markup in metadata stays text);
- a sandbox's page (--vm, else the first running sandbox that is no fork)
  shows its state, and its processes and files sections say what the API
  answers for them (the test guest has no agent: an error, shown);
- Pause: the API says `paused` and so does the page; Resume likewise;
- Fork with count 2: two children appear in the API (parentVmId) and on the
  page (lineage), and the fork's snapshot in its snapshots;
- a screenshot of that page goes to SCREENSHOT_PATH (1280 px wide, the whole
  page); a child's page links back to its parent.

With --api-key (sproutd --tenants), the page must first ask for the key and
show no sandbox; the key is typed into its form. --list-only stops after the
list and the sandbox's page are shown (no actions).

Waits are conditions polled against a deadline, never fixed sleeps. Exits 1
with what failed (and a screenshot beside SCREENSHOT_PATH, .failed.png).
"""

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request

from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT = 120  # seconds: a loaded 2-core machine

driver = None
shot_path = None
# The browser's profile, removed at the end.
profile = tempfile.TemporaryDirectory(prefix="sprout-dashboard-chromium-")


class Failed(Exception):
    pass


def log(msg):
    print(f"check.py: {msg}", file=sys.stderr, flush=True)


class Api:
    def __init__(self, base, key):
        self.base = base.rstrip("/")
        self.key = key

    def call(self, method, path, body=None):
        """(status, JSON) of one request."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method)
        if body is not None:
            req.add_header("Content-Type", "application/json")
        if self.key:
            req.add_header("Authorization", f"Bearer {self.key}")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            text = e.read()
            try:
                return e.code, json.loads(text)
            except ValueError:
                return e.code, text.decode(errors="replace")

    def get(self, path):
        st, v = self.call("GET", path)
        if st != 200:
            raise Failed(f"GET {path}: {st} {v}")
        return v

    def vms(self):
        return self.get("/v1/runtime/vms")["vms"]


def page_error():
    """The page's own error banner, if shown."""
    try:
        e = driver.find_element(By.ID, "error")
        return e.text if e.is_displayed() else ""
    except WebDriverException:
        return ""


def wait(what, cond, timeout=WAIT):
    """cond()'s first true value, polled until the deadline."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            v = cond()
            if v:
                return v
            last = v
        except (WebDriverException, Failed, OSError) as e:
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() > deadline:
            banner = page_error()
            raise Failed(
                f"timed out after {timeout} s waiting for {what} (last: {last!r})"
                + (f"; the page's error banner says: {banner}" if banner else "")
            )
        time.sleep(0.2)


def css(sel):
    return driver.find_element(By.CSS_SELECTOR, sel)


def css_all(sel):
    return driver.find_elements(By.CSS_SELECTOR, sel)


def text(sel):
    """The element's textContent (what the page says, shown or not)."""
    return driver.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.textContent : null;", sel
    )


def shown(sel):
    els = css_all(sel)
    return bool(els) and els[0].is_displayed()


def browser():
    opts = Options()
    opts.binary_location = CHROMIUM
    for a in [
        "--headless=new",
        "--no-sandbox",  # run as root
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1280,900",
        "--hide-scrollbars",
        f"--user-data-dir={profile.name}",
    ]:
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    opts.page_load_strategy = "normal"
    for p in (CHROMIUM, CHROMEDRIVER):
        if not os.access(p, os.X_OK):
            raise Failed(f"{p} is missing: tests/dashboard/install.sh installs it")
    # The driver's path given: Selenium Manager is not asked for one.
    d = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    d.set_page_load_timeout(WAIT)
    d.set_script_timeout(WAIT)
    return d


def console_errors():
    """Script errors and policy (CSP) violations the page logged."""
    bad = []
    for e in driver.get_log("browser"):
        if e.get("level") != "SEVERE":
            continue
        if e.get("source") in ("javascript", "security"):
            bad.append(e.get("message"))
    return bad


def screenshot(path):
    """The whole page, 1280 px wide (the window is 1280x900)."""
    import base64

    # From the top (the bar at the top is sticky: scrolled, it would be
    # drawn part way down the picture).
    size = driver.execute_script(
        "window.scrollTo(0, 0);"
        "return [document.documentElement.scrollWidth, document.documentElement.scrollHeight];"
    )
    w, h = max(1280, size[0]), max(900, size[1])
    png = driver.execute_cdp_cmd(
        "Page.captureScreenshot",
        {
            "format": "png",
            "captureBeyondViewport": True,
            "clip": {"x": 0, "y": 0, "width": w, "height": h, "scale": 1},
        },
    )["data"]
    with open(path, "wb") as f:
        f.write(base64.b64decode(png))


def give_key(key):
    """The page asks for a key, shows no sandbox; the key goes into its form."""
    wait("the API key form", lambda: shown("#auth"))
    msg = text("#auth-message") or ""
    if "unauthorized" not in msg:
        raise Failed(f"the key form does not quote the API's 401: {msg!r}")
    if css_all("#vms tbody tr"):
        raise Failed("sandboxes are listed before a key was given")
    css("#api-key").send_keys(key)
    css("#api-key-save").click()
    wait("the key form to go", lambda: not shown("#auth"))
    stored = driver.execute_script("return sessionStorage.getItem('sprout.apiKey');")
    if stored != key:
        raise Failed("the key is not kept in sessionStorage")


def check_list(api):
    vms = api.vms()
    if not vms:
        raise Failed("the API lists no sandbox: the test makes some first")
    for vm in vms:
        row = f'#vms tbody tr[data-vm-id="{vm["vmId"]}"]'
        wait(
            f"the list's row of {vm['vmId']} saying {vm['state']}",
            lambda: shown(row) and text(f'{row} [data-field="state"]') == vm["state"],
        )
        cells = text(row)
        want = f"{vm['cpus']} vCPU"
        if want not in cells or f"{vm['memoryMb']} MiB" not in cells:
            raise Failed(f"row {vm['vmId']} does not show its shape: {cells!r}")
        for k, v in vm["metadata"].items():
            if f"{k}={v}" not in cells:
                raise Failed(f"row {vm['vmId']} does not show its metadata {k}={v}: {cells!r}")
    # Markup in metadata is text: no element was made of it.
    if css_all("#vms img, #vms script, #vms iframe"):
        raise Failed("metadata markup became elements in the list")
    count = text("#count") or ""
    if str(len(vms)) not in count:
        raise Failed(f"the count says {count!r} for {len(vms)} sandboxes")
    log(f"the list shows the {len(vms)} sandboxes")
    return vms


def pick(vms, want):
    if want:
        return want
    for vm in vms:
        if vm["state"] == "running" and not vm["parentVmId"]:
            return vm["vmId"]
    raise Failed(f"no running sandbox that is no fork among {[v['vmId'] for v in vms]}")


def open_vm(base, vm_id):
    css(f'#vms tbody tr[data-vm-id="{vm_id}"] a.vm-link').click()
    wait("the sandbox's page", lambda: driver.current_url == f"{base}/dashboard/vms/{vm_id}")
    wait("the page's state to say running", lambda: text("#state") == "running")
    if text("#fact-vmId") != vm_id:
        raise Failed(f"the page shows the id {text('#fact-vmId')!r}")
    log(f"opened {vm_id}")


def check_sections(api, vm_id):
    """Processes and files show what the API answers (an error: its code)."""
    for name, path in (("processes", "processes"), ("files", "files?path=.")):
        st, v = api.call("GET", f"/v1/runtime/vms/{vm_id}/{path}")
        if st == 200:
            table = "#process-table" if name == "processes" else "#file-table"
            empty = f"#{name}-empty"
            wait(f"the {name} section", lambda: shown(table) or shown(empty))
        else:
            code = v["error"]["code"]
            wait(
                f"the {name} section to show the API's {code}",
                lambda: shown(f"#{name}-error") and code in (text(f"#{name}-error") or ""),
            )
            log(f"{name}: the page shows {text(f'#{name}-error')!r}")


def action(api, vm_id, name, want_state):
    button = css(f'[data-action="{name}"]')
    wait(f"{name} to be enabled", button.is_enabled)
    button.click()
    wait(
        f"the API to say {want_state} after {name}",
        lambda: api.get(f"/v1/runtime/vms/{vm_id}")["state"] == want_state,
    )
    wait(f"the page to say {want_state}", lambda: text("#state") == want_state)
    log(f"{name}: the API and the page say {want_state}")


def check_buttons(state):
    """Only the actions the state allows are enabled."""
    enabled = {
        "running": {"pause", "fork", "snapshot", "delete"},
        "paused": {"resume", "fork", "snapshot", "delete"},
    }[state]
    wait(
        f"the enabled actions of a {state} sandbox to be {sorted(enabled)}",
        lambda: {b.get_attribute("data-action") for b in css_all("[data-action]") if b.is_enabled()}
        == enabled,
    )


def fork(api, vm_id, count):
    before = {v["vmId"] for v in api.vms() if v["parentVmId"] == vm_id}
    box = css("#fork-count")
    box.clear()
    box.send_keys(str(count))
    action_button = css('[data-action="fork"]')
    wait("fork to be enabled", action_button.is_enabled)
    action_button.click()

    def kids():
        k = [v for v in api.vms() if v["parentVmId"] == vm_id and v["vmId"] not in before]
        return k if len(k) >= count and all(v["state"] == "running" for v in k) else None

    new = wait(f"{count} running children in the API", kids)
    ids = {v["vmId"] for v in new}
    if len(ids) != count:
        raise Failed(f"the fork made {len(ids)} children, not {count}")
    want = ids | before
    wait(
        f"the page's lineage to list the children {sorted(want)}",
        lambda: {li.get_attribute("data-vm-id") for li in css_all("#children li")} == want,
    )
    wait("the action status to say Forked", lambda: "Forked" in (text("#action-status") or ""))
    snaps = [s for s in api.get("/v1/runtime/snapshots")["snapshots"] if s["vmId"] == vm_id]
    wait(
        f"the page to list the sandbox's {len(snaps)} snapshots",
        lambda: {r.get_attribute("data-snapshot-id") for r in css_all("#snapshots tbody tr")}
        >= {s["snapshotId"] for s in snaps}
        and len(snaps) > 0,
    )
    log(f"fork {count}: the API and the page show the children {sorted(ids)}")
    return sorted(ids)


def run(args):
    global driver
    base = args.base_url.rstrip("/")
    api = Api(base, args.api_key)
    driver = browser()
    log(f"chromium {driver.capabilities.get('browserVersion')} up")
    driver.get(f"{base}/dashboard")
    if args.api_key:
        give_key(args.api_key)
    vms = check_list(api)
    vm_id = pick(vms, args.vm)
    open_vm(base, vm_id)
    check_sections(api, vm_id)
    if args.list_only:
        screenshot(args.screenshot)
        return
    check_buttons("running")
    action(api, vm_id, "pause", "paused")
    check_buttons("paused")
    action(api, vm_id, "resume", "running")
    check_buttons("running")
    kids = fork(api, vm_id, 2)
    # The state of every child settles on the page, then the picture.
    wait(
        "the children to show running",
        lambda: all(
            text(f'#children li[data-vm-id="{k}"] .state') == "running" for k in kids
        ),
    )
    # No hover or focus on a button in the picture.
    driver.execute_script("document.activeElement && document.activeElement.blur();")
    ActionChains(driver).move_to_element(css("#vm-title")).perform()
    screenshot(args.screenshot)
    log(f"screenshot: {args.screenshot}")
    # A child's page links back to its parent.
    driver.get(f"{base}/dashboard/vms/{kids[0]}")
    wait("the child's page", lambda: text("#state") == "running")
    wait(
        "the child's parent link",
        lambda: css_all(f'#lineage-parent a[href="/dashboard/vms/{vm_id}"]'),
    )
    log("the child's page links to its parent")


def main():
    global shot_path
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base_url")
    p.add_argument("screenshot")
    p.add_argument("--vm", help="the sandbox to open (default: the first running one)")
    p.add_argument("--api-key", help="sproutd --tenants: the key to type into the page")
    p.add_argument("--list-only", action="store_true", help="no actions")
    args = p.parse_args()
    shot_path = args.screenshot
    # A hung browser must not hang the test: the whole check has a deadline.
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(Failed("check.py ran 900 s")))
    signal.alarm(900)
    try:
        run(args)
        errors = console_errors()
        if errors:
            raise Failed(f"the page logged errors: {errors}")
    except Exception as e:  # noqa: BLE001 (every failure is reported the same way)
        log(f"FAILED: {e if isinstance(e, Failed) else repr(e)}")
        if driver is not None:
            try:
                screenshot(shot_path + ".failed.png")
                log(f"the page then: {shot_path}.failed.png; at {driver.current_url}")
                for e in driver.get_log("browser"):
                    log(f"browser: {e.get('level')} {e.get('source')}: {e.get('message')}")
            except WebDriverException:
                pass
        return 1
    finally:
        if driver is not None:
            driver.quit()
        profile.cleanup()
    log("passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
