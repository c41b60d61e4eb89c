"""Issue 23, item 8: the internal-address guard knows every address of its host.

The whole node runs in a network namespace made for this test, whose interface has a
primary address and a secondary one in the same subnet (the old guard, SIOCGIFADDR, saw
only the primary); a peer namespace behind a veth pair has another address of the same
subnet. A web server listens on both sides. A guest with `open` egress reaches the peer
but not the host's secondary address, nor the host by its IPv6 or NAT64 forms (names via
PAL_EGRESS_RESOLVE). Every address exists only inside the test's namespaces.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from tests.conftest import REPO, TEST_DATA_DIR, free_port, pal_cli, scratch_run_dir

pytestmark = pytest.mark.vm

T = TypeVar("T")
DEADLINE_S = 900  # hang guard (a loaded 2-core host), not a speed bound
PRIMARY, SECONDARY, PEER = "11.22.33.1", "11.22.33.44", "11.22.33.99"
HOST_V6 = "2a00:1450::44"
WEB_PORT = 8080
RESOLVE = f"v6host.test={HOST_V6},nat64host.test=64:ff9b::b16:212c"  # 11.22.33.44, NAT64


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def _namespaces() -> Iterator[tuple[str, str]]:
    tag = uuid.uuid4().hex[:6]
    host, peer = f"paltest-h-{tag}", f"paltest-p-{tag}"
    for ns in (host, peer):
        _ip("netns", "add", ns)
    try:
        _ip("-n", host, "link", "add", "h0", "type", "veth", "peer", "name", "p0")
        _ip("-n", host, "link", "set", "p0", "netns", peer)
        for ns, dev, addrs in ((host, "h0", [PRIMARY, SECONDARY]), (peer, "p0", [PEER])):
            for a in addrs:
                _ip("-n", ns, "addr", "add", f"{a}/24", "dev", dev)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")
        _ip("-n", host, "addr", "add", f"{HOST_V6}/64", "dev", "h0", "nodad")
        yield host, peer
    finally:
        for ns in (host, peer):
            subprocess.run(["ip", "netns", "delete", ns], check=False)


def _enter(ns: str) -> None:
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), "setns")
    finally:
        os.close(fd)


class NsApi:
    """An API client whose sockets live in namespace ``ns`` (one thread that entered it)."""

    def __init__(self, ns: str, url: str, key: str) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(1, initializer=_enter, initargs=(ns,))
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = self.run(lambda: httpx.Client(base_url=url, headers=headers, timeout=300))

    def run(self, fn: Callable[[], T]) -> T:
        return self.pool.submit(fn).result()

    def __getattr__(self, verb: str) -> Callable[..., httpx.Response]:
        return lambda *a, **kw: self.run(lambda: getattr(self.client, verb)(*a, **kw))

    def close(self) -> None:
        self.run(self.client.close)
        self.pool.shutdown()


def _serve(ns: str, log: Path) -> subprocess.Popen[bytes]:
    cmd = [
        "nsenter",
        f"--net=/run/netns/{ns}",
        sys.executable,
        "-m",
        "http.server",
        str(WEB_PORT),
        "--bind",
        "0.0.0.0",
    ]
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, cwd=log.parent)


def _wait_healthy(api: NsApi, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.time() + DEADLINE_S
    while time.time() < deadline:
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        with contextlib.suppress(httpx.HTTPError):
            if api.get("/healthz").status_code == 200:
                return
        time.sleep(0.3)
    raise AssertionError("pal up did not become healthy")


def _sh(api: NsApi, vm: str, line: str) -> dict[str, Any]:
    r = api.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "/bin/sh", "argv": ["-c", line]})
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_a_guest_cannot_reach_its_hosts_secondary_or_ipv6_addresses() -> None:
    with _namespaces() as (host_ns, peer_ns), scratch_run_dir("hostaddr") as run_dir:
        run_dir.mkdir(parents=True, exist_ok=True)
        for shared in ("images", "templates"):
            (run_dir / shared).symlink_to(TEST_DATA_DIR / shared)
        (run_dir / "www").mkdir()
        (run_dir / "www" / "index.html").write_text("hello\n")
        webs = [_serve(ns, run_dir / "www" / f"{ns}.log") for ns in (host_ns, peer_ns)]
        port = free_port()
        log = run_dir / "server.log"
        env = {
            **os.environ,
            "PAL_DATA_DIR": str(run_dir),
            "PAL_LOG_LEVEL": "INFO",
            "PAL_EGRESS_RESOLVE": RESOLVE,
            "PAL_EGRESS_DNS": "static",
            "PAL_HARNESS_READY_TIMEOUT_MS": "60000",
            "PAL_TEMPLATE_SIZES": "256m-1c-2048d",
        }
        cmd = ["nsenter", f"--net=/run/netns/{host_ns}", sys.executable, "-m", "pal.cli.main", "up",
               "--port", str(port), "--data-dir", str(run_dir)]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env, cwd=REPO)
        api: NsApi | None = None
        try:
            probe = NsApi(host_ns, f"http://127.0.0.1:{port}", "")
            _wait_healthy(probe, proc, log)
            probe.close()
            made = pal_cli("tenants", "create", "t", "--max-vms", "4", "--data-dir", str(run_dir))
            key = json.loads(made.stdout)["apiKey"]
            api = NsApi(host_ns, f"http://127.0.0.1:{port}", key)
            r = api.post("/v1/runtime/schedule", json={"egress": "open"})
            assert r.status_code == 200, r.text
            vm = r.json()["vmId"]
            curl = "curl -sS --max-time 30 -o /dev/null -w '%{http_code}' "
            out = _sh(api, vm, "; ".join(f"{curl} http://{a}:{WEB_PORT}/; echo ' rc='$?" for a in (
                PEER, SECONDARY, PRIMARY)) + f"; {curl} http://v6host.test:{WEB_PORT}/; echo ' rc='$?"
                f"; {curl} http://nat64host.test:{WEB_PORT}/; echo ' rc='$?")  # fmt: skip
            lines = out["stdout"].splitlines()
            assert lines[0].endswith("200 rc=0"), f"the peer is reachable: {out}"
            assert all(not line.endswith("rc=0") for line in lines[1:]), out
            assert len(lines) == 5, out
            deadline = time.time() + 120
            rules: list[dict[str, Any]] = []
            while time.time() < deadline:
                evs = api.get(f"/v1/runtime/vms/{vm}/events").json()["events"]
                rules = [e["details"] for e in evs if e["kind"] == "egress_denied"]
                if {SECONDARY, PRIMARY} <= {d.get("address") for d in rules} and len(rules) >= 4:
                    break
                time.sleep(0.5)
            by_addr = {d.get("address"): d["rule"] for d in rules}
            assert "internal" in by_addr.get(SECONDARY, ""), rules
            assert {d.get("name") for d in rules} >= {"v6host.test", "nat64host.test"}, rules
            api.delete(f"/v1/runtime/vms/{vm}")
        finally:
            if api is not None:
                api.close()
            proc.terminate()
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for w in webs:
                w.terminate()
                w.wait(10)
