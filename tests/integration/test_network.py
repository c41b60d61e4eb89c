"""Issue: every sandbox gets a NIC behind the host's egress gateway, with a per-VM policy.

Real VMs, real curl and Python in the guest, servers on the host's 127.0.0.2 (see
tests/netservers.py). Each test packs its guest-side checks into few exec calls: under
TCG every exec of a fresh process costs about a second.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import PalServer, netns_of, qemu_pids_under
from tests.leaks import vm_dir_of
from tests.netservers import HELLO, Upstream

pytestmark = pytest.mark.vm

DEADLINE_S = 120  # generous: polls end as soon as the condition holds

# A client that resolves api.test, starts a response that never ends, and reports how its
# read ended (after a pause/resume it must end, with a reset, not hang).
HANGING_CLIENT = """
import socket
s = socket.create_connection(("api.test", PORT))
open("/tmp/addr", "w").write(s.getpeername()[0])
s.sendall(b"GET /hang HTTP/1.1\\r\\nHost: api.test\\r\\n\\r\\n")
s.recv(65536)
open("/tmp/client", "w").write("waiting")
try:
    while s.recv(65536):
        pass
    r = "eof"
except OSError as e:
    r = type(e).__name__
open("/tmp/client", "w").write(r)
"""

TIMED_FETCH = """
import time, urllib.request
t = time.time()
urllib.request.urlopen("URL", timeout=60).read()
print(time.time() - t)
"""

# The guarantee: "a connection to a name outside the allowlist fails within 1 s".
# Timed by the guest itself (no exec or interpreter start-up in the figure): a lookup of a
# name the list does not have, and a connection to a listed name on a port it does not list.
TIMED_REFUSALS = """
import socket, time
t = time.monotonic()
try:
    socket.getaddrinfo("evil.test", 80)
    print("lookup resolved")
except OSError:
    print("lookup %.3f" % (time.monotonic() - t))
addr = socket.getaddrinfo("api.test", PORT)[0][4]  # resolved first: only the refusal is timed
t = time.monotonic()
try:
    s = socket.create_connection(addr, timeout=30)
    s.sendall(b"GET / HTTP/1.1\\r\\nHost: api.test\\r\\n\\r\\n")
    got = s.recv(1)
    print("connect %.3f" % (time.monotonic() - t) if got == b"" else "connect answered")
except OSError:
    print("connect %.3f" % (time.monotonic() - t))
"""

# SYNs to many addresses, DNS lookups of ever new names, and connections held open. The
# flooder's policy allows only api.test: the gateway refuses the SYNs (to RFC 5737's
# unrouted documentation range) and the lookups itself, so nothing leaves the machine.
FLOOD = """
import socket, threading, time
def syns():
    i = 0
    while True:
        i += 1
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("203.0.113.%d" % (i % 250 + 1), 80))
        except OSError:
            pass
        s.close()
def dns():
    i = 0
    while True:
        i += 1
        try:
            socket.getaddrinfo("n%d.flood.test" % i, 80)
        except OSError:
            pass
def conns():
    held = []
    while True:
        try:
            held.append(socket.create_connection(("api.test", PORT), timeout=2))
        except OSError:
            time.sleep(0.01)
        if len(held) > 200:
            for h in held:
                h.close()
            held = []
for f in (syns, dns, dns, conns):
    threading.Thread(target=f, daemon=True).start()
time.sleep(600)
"""


def sh(api: httpx.Client, vm: str, line: str, timeout: float | None = None) -> dict:
    body: dict = {"command": "/bin/sh", "argv": ["-c", line]}
    if timeout:
        body["timeoutSecs"] = timeout
    r = api.post(f"/v1/runtime/vms/{vm}/exec", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def schedule(api: httpx.Client, **spec: object) -> str:
    r = api.post("/v1/runtime/schedule", json=spec)
    assert r.status_code == 200, r.text
    return str(r.json()["vmId"])


def denied_events(api: httpx.Client, vm: str) -> list[dict]:
    return [
        e for e in api.get(f"/v1/runtime/vms/{vm}/events").json()["events"] if e["kind"] == "egress_denied"
    ]


def wait_for_denied(api: httpx.Client, vm: str, pred: object) -> dict:
    deadline = time.time() + DEADLINE_S
    while time.time() < deadline:
        for e in denied_events(api, vm):
            if pred(e):  # type: ignore[operator]
                return e
        time.sleep(0.5)
    raise AssertionError(f"no matching egress_denied event: {denied_events(api, vm)}")


def fetch(api: httpx.Client, vm: str, url: str, extra: str = "") -> dict:
    """curl in the guest; stdout is the body, exit code curl's."""
    return sh(api, vm, f"curl -sS --max-time 30 {extra} {url}")


@pytest.fixture
def vms(api: httpx.Client) -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    for vm in made:
        api.delete(f"/v1/runtime/vms/{vm}")


def test_allowlist_http_https_sni_and_refusals(api: httpx.Client, upstream: Upstream, vms: list[str]) -> None:
    up = upstream
    allow = [f"api.test:{up.http_port}", f"tls.test:{up.tls_port}", "loop.test"]
    vm = schedule(api, egress={"allow": allow})
    vms.append(vm)
    assert api.get(f"/v1/runtime/vms/{vm}").json()["egress"] == {"allow": allow}
    api.put(f"/v1/runtime/vms/{vm}/files/content", params={"path": "ca.pem"}, content=up.ca_pem)
    http_url = f"http://api.test:{up.http_port}/hello"
    # curl and urllib, no proxy variables anywhere.
    out = sh(
        api,
        vm,
        "env | grep -ci proxy; "
        f"curl -sS --max-time 30 {http_url}; "
        f"python3 -c \"import urllib.request as u; print(u.urlopen('{http_url}').read().decode(), end='')\"; "
        # https by name (the gateway's DNS named it) ...
        f"curl -sS --max-time 30 --cacert ca.pem https://tls.test:{up.tls_port}/host; echo; "
        # ... and to a bare IP, named only by the TLS SNI: the gateway connects to what *it*
        # resolves for tls.test (127.0.0.2), never to the IP the guest asked for.
        f"curl -sS --max-time 30 --cacert ca.pem --resolve tls.test:{up.tls_port}:203.0.113.10 "
        f"https://tls.test:{up.tls_port}/host; echo; "
        # an SNI not in the list, to the same bare IP: refused
        f"curl -sS --max-time 30 -k --resolve other.test:{up.tls_port}:203.0.113.10 "
        f"https://other.test:{up.tls_port}/host; echo rc=$?",
    )
    lines = out["stdout"].splitlines()
    assert lines[0] == "0", "no proxy variable in the guest's environment"
    assert lines[1:3] == [HELLO.decode().strip()] * 2, out
    assert lines[3] == f"tls.test:{up.tls_port}" and lines[4] == f"tls.test:{up.tls_port}", out
    assert lines[5].startswith("rc=") and lines[5] != "rc=0", out
    # The refusals' speed is a product guarantee of the issue (< 1 s), so here, unlike
    # elsewhere, a bound on time is the assertion itself.
    timed = TIMED_REFUSALS.replace("PORT", str(up.tls_port))
    api.put(f"/v1/runtime/vms/{vm}/files/content", params={"path": "timed.py"}, content=timed)
    got = dict(line.split() for line in sh(api, vm, "python3 timed.py")["stdout"].splitlines())
    assert got.keys() == {"lookup", "connect"} and all(v[0].isdigit() for v in got.values()), got
    assert float(got["lookup"]) < 1.0 and float(got["connect"]) < 1.0, got
    # Outside the allow list: the name does not resolve; a port not listed is reset.
    out = sh(
        api,
        vm,
        "curl -sS --max-time 30 http://evil.test/ ; echo rc=$?; "
        f"curl -sS --max-time 30 http://api.test:{up.tls_port}/ ; echo rc=$?; "
        # loop.test is allowed, but points at 127.0.0.1: internal, refused at DNS
        "curl -sS --max-time 30 http://loop.test/ ; echo rc=$?",
    )
    rcs = [line for line in out["stdout"].splitlines() if line.startswith("rc=")]
    assert rcs == ["rc=6", "rc=56", "rc=6"] or (rcs[0] == "rc=6" and rcs[1] != "rc=0" and rcs[2] == "rc=6"), (
        out
    )
    ev = wait_for_denied(api, vm, lambda e: e["details"]["name"] == "evil.test")
    assert ev["details"]["rule"] == "not in the allow list" and "evil.test" in ev["reason"]
    wait_for_denied(
        api, vm, lambda e: e["details"].get("port") == up.tls_port and e["details"]["name"] == "api.test"
    )
    wait_for_denied(api, vm, lambda e: e["details"]["name"] == "other.test")  # the SNI refusal
    wait_for_denied(
        api, vm, lambda e: e["details"]["name"] == "loop.test" and "internal" in e["details"]["rule"]
    )
    got = api.get(f"/v1/runtime/vms/{vm}").json()["network"]
    assert got["connections"] >= 5 and got["bytesIn"] > 0 and got["bytesOut"] > 0
    assert got["refused"] >= 3 and got["dnsQueries"] >= 3


def test_none_and_open_policies(api: httpx.Client, upstream: Upstream, vms: list[str]) -> None:
    none_vm = schedule(api, egress="none")
    open_vm = schedule(api, egress="open")
    vms += [none_vm, open_vm]
    url = f"http://api.test:{upstream.http_port}/hello"
    probe = (
        "getent hosts api.test; echo dns=$?; "
        f"curl -sS --max-time 30 {url}; echo rc=$?; "
        # a bare IP, no name at all
        f"curl -sS --max-time 30 http://203.0.113.10:{upstream.http_port}/; echo rc=$?; "
        # the metadata address, and loopback by name: internal under any policy
        "curl -sS --max-time 30 http://169.254.169.254/; echo rc=$?; "
        "curl -sS --max-time 30 http://loop.test/; echo rc=$?"
    )
    out = sh(api, none_vm, probe)["stdout"].splitlines()
    assert "dns=2" in out, f"DNS answers nothing: {out}"
    rcs = [line for line in out if line.startswith("rc=")]
    assert len(rcs) == 4 and "rc=0" not in rcs, out
    wait_for_denied(api, none_vm, lambda e: e["details"]["rule"] == "egress none")
    out = sh(api, open_vm, probe)["stdout"].splitlines()
    assert "dns=0" in out and HELLO.decode().strip() in out, out
    rcs = [line for line in out if line.startswith("rc=")]
    assert rcs[0] == "rc=0" and "rc=0" not in rcs[1:], f"open still refuses internal addresses: {out}"
    wait_for_denied(api, open_vm, lambda e: e["details"].get("address") == "169.254.169.254")
    wait_for_denied(api, open_vm, lambda e: e["details"].get("name") == "loop.test")


def test_live_change_applies_to_the_next_connection(
    api: httpx.Client, upstream: Upstream, vms: list[str]
) -> None:
    vm = schedule(api, egress="open")
    vms.append(vm)
    url = f"http://api.test:{upstream.http_port}/hello"
    # a download in progress when the policy changes is cut
    hang = f"http://api.test:{upstream.http_port}/hang"
    hung_before = upstream.hung.count("/hang")  # the upstream is the session's: count, not look
    sh(
        api,
        vm,
        f"(curl -sS --max-time 300 -o /tmp/hang.out {hang} 2>/tmp/hang.err; echo rc=$? >>/tmp/hang.err) "
        ">/dev/null 2>&1 &",
    )
    deadline = time.time() + DEADLINE_S
    while upstream.hung.count("/hang") == hung_before and time.time() < deadline:
        time.sleep(0.2)
    assert upstream.hung.count("/hang") == hung_before + 1, "this VM's download reached the upstream"
    r = api.put(f"/v1/runtime/vms/{vm}/egress", json={"egress": {"allow": ["other.test"]}})
    assert r.status_code == 200 and r.json()["egress"] == {"allow": ["other.test"]}, r.text
    out = sh(
        api,
        vm,
        f"curl -sS --max-time 30 {url}; echo rc=$?; "
        "for i in $(seq 600); do grep -q rc= /tmp/hang.err && break; sleep 0.1; done; cat /tmp/hang.err",
    )
    rcs = [line for line in out["stdout"].splitlines() if line.startswith("rc=")]
    assert rcs[0] == "rc=6", out  # api.test no longer resolves
    # The download (its upstream holds the response open for minutes) ended, and in error
    # (curl 56 or 18): the change reset it. Still running, it would have written no rc= line.
    assert len(rcs) == 2 and rcs[1] != "rc=0", f"the open download was not cut: {out}"
    r = api.put(
        f"/v1/runtime/vms/{vm}/egress", json={"egress": {"allow": [f"api.test:{upstream.http_port}"]}}
    )
    assert r.status_code == 200
    assert fetch(api, vm, url)["stdout"] == HELLO.decode()
    r = api.put(f"/v1/runtime/vms/{vm}/egress", json={"egress": {"allow": ["ok.test", "bad entry!"]}})
    assert r.status_code == 400 and "bad entry!" in r.json()["error"]["message"]
    kinds = [e["kind"] for e in api.get(f"/v1/runtime/vms/{vm}/events").json()["events"]]
    assert kinds.count("egress_changed") == 2


def test_bad_policies_are_400_naming_the_entry(api: httpx.Client) -> None:
    for egress, says in [
        ("bogus", "egress must be"),
        ({"allow": ["pypi.org", "not a host"]}, "not a host"),
        ({"deny": ["1.2.3.4:70000"]}, "1.2.3.4:70000"),
        ({"allow": [f"h{i}.test" for i in range(257)]}, "at most 256"),
    ]:
        r = api.post("/v1/runtime/schedule", json={"egress": egress})
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text


def test_network_survives_pause_resume_fork_and_idle_wake(
    pal_server: PalServer, api: httpx.Client, upstream: Upstream, vms: list[str]
) -> None:
    url = f"http://api.test:{upstream.http_port}/hello"
    # other.test is served by the same host server, but the policy does not list it: it must
    # stay refused in every restored incarnation, not only be stored on the row.
    refused = f"curl -sS --max-time 30 http://other.test:{upstream.http_port}/hello; echo rc=$?"
    vm = schedule(api, egress={"allow": [f"api.test:{upstream.http_port}"]}, idleTimeoutSecs=3)
    vms.append(vm)
    # A client holding the synthetic address it resolved, mid-response at pause time.
    client = HANGING_CLIENT.replace("PORT", str(upstream.http_port))
    api.put(f"/v1/runtime/vms/{vm}/files/content", params={"path": "client.py"}, content=client)
    out = sh(
        api,
        vm,
        "setsid python3 client.py >/dev/null 2>&1 & "
        "for i in $(seq 600); do [ -s /tmp/client ] && break; sleep 0.1; done; cat /tmp/client /tmp/addr; "
        "echo; cat /sys/class/net/eth0/address",
    )
    first, mac_before = out["stdout"].splitlines()
    assert first.startswith("waiting198.18."), out
    addr = first.removeprefix("waiting")
    assert api.post(f"/v1/runtime/vms/{vm}/pause").status_code == 200
    # Its network goes with its QEMU: freed, or kept by the parked QEMU (pal/manager/parked.py).
    vm_dir = vm_dir_of(pal_server.data_dir, vm)  # named by its slot, as its namespace is
    parked = qemu_pids_under(vm_dir)
    assert netns_of(pal_server.data_dir).count(f"pal-{netns_tag(pal_server)}-{vm_dir.name}") == len(parked)
    assert api.post(f"/v1/runtime/vms/{vm}/resume").status_code == 200
    # The open connection is reset, not hung; the cached synthetic address still works.
    out = sh(
        api,
        vm,
        'for i in $(seq 600); do [ "$(cat /tmp/client)" != waiting ] && break; sleep 0.1; done; '
        f"cat /tmp/client; echo; curl -sS --max-time 30 http://{addr}:{upstream.http_port}/hello; "
        f"curl -sS --max-time 30 {url}; cat /sys/class/net/eth0/address; {refused}",
    )
    lines = out["stdout"].splitlines()
    assert lines[0] in ("ConnectionAbortedError", "ConnectionResetError"), out
    assert lines[1:3] == [HELLO.decode().strip()] * 2, out
    assert lines[3] != mac_before, "the restored incarnation has its own MAC"
    assert lines[4].startswith("rc=") and lines[4] != "rc=0", f"the policy holds after resume: {out}"
    # Fork x3: every child fetches, each with its own MAC.
    r = api.post(f"/v1/runtime/vms/{vm}/fork", json={"count": 3})
    assert r.status_code == 200, r.text
    kids = [f["vmId"] for f in r.json()["forks"]]
    vms.extend(kids)
    macs = set()
    for k in kids:
        out = sh(api, k, f"curl -sS --max-time 30 {url}; cat /sys/class/net/eth0/address; {refused}")
        body, mac, rc = out["stdout"].splitlines()
        assert body + "\n" == HELLO.decode(), out
        assert rc.startswith("rc=") and rc != "rc=0", f"the policy holds in a fork child: {out}"
        macs.add(mac)
        assert api.get(f"/v1/runtime/vms/{k}").json()["egress"] == {
            "allow": [f"api.test:{upstream.http_port}"]
        }
    assert len(macs) == 3 and lines[3] not in macs
    # Idle suspend, then a fetch wakes it and works at once.
    deadline = time.time() + DEADLINE_S
    while api.get(f"/v1/runtime/vms/{vm}").json()["state"] != "paused" and time.time() < deadline:
        time.sleep(0.5)
    assert api.get(f"/v1/runtime/vms/{vm}").json()["pausedBy"] == "idle"
    out = sh(api, vm, f"curl -sS --max-time 30 {url}; {refused}")  # the exec wakes it
    assert out["stdout"].splitlines()[0] + "\n" == HELLO.decode(), out
    rc = out["stdout"].splitlines()[1]
    assert rc.startswith("rc=") and rc != "rc=0", f"the policy holds after the idle wake: {out}"
    net = api.get(f"/v1/runtime/vms/{vm}").json()["network"]
    assert net["connections"] >= 4, "counters add up over incarnations"


def netns_tag(server: PalServer) -> str:
    from pal.network import netns

    return netns.node_tag(server.data_dir)


def test_a_flooding_guest_slows_only_itself(api: httpx.Client, upstream: Upstream, vms: list[str]) -> None:
    url = f"http://api.test:{upstream.http_port}/bytes/{2 * 1024 * 1024}"
    victim = schedule(api, egress="open")
    # Its SYNs to other addresses and its lookups of other names are refused by its policy
    # before anything leaves the machine; its connections to api.test meet its limit.
    flooder = schedule(
        api, egress={"allow": [f"api.test:{upstream.http_port}"]}, limits={"maxConnections": 16}
    )
    vms += [victim, flooder]
    api.put(
        f"/v1/runtime/vms/{victim}/files/content",
        params={"path": "t.py"},
        content=TIMED_FETCH.replace("URL", url),
    )

    def measure() -> tuple[float, float]:
        fetches = [float(sh(api, victim, "python3 t.py")["stdout"]) for _ in range(3)]
        t = time.monotonic()
        for _ in range(5):
            assert api.get(f"/v1/runtime/vms/{victim}").status_code == 200
        return statistics.median(fetches), time.monotonic() - t

    def flood_stats() -> dict[str, int]:
        return dict(api.get(f"/v1/runtime/vms/{flooder}").json()["network"])

    base_fetch, base_api = measure()
    flood = FLOOD.replace("PORT", str(upstream.http_port))
    api.put(f"/v1/runtime/vms/{flooder}/files/content", params={"path": "flood.py"}, content=flood)
    sh(api, flooder, "setsid python3 flood.py >/dev/null 2>&1 &")
    deadline = time.time() + DEADLINE_S
    while (before := flood_stats())["refused"] == 0 or before["dnsQueries"] == 0:
        assert time.time() < deadline, f"the flood never hit its limits: {before}"
        time.sleep(0.5)
    flood_fetch, flood_api = measure()  # each fetch returned its 2 MiB, the API answered
    stats = flood_stats()
    # The flood went on during the victim's fetches: they were not served by a quiet gateway.
    assert stats["refused"] > before["refused"], (before, stats)
    print(json.dumps({"fetch": [base_fetch, flood_fetch], "api": [base_api, flood_api], "flooder": stats}))
    # Relative to the same run's baseline: the flooder's own vCPU takes one of the host's
    # cores, so some slowdown is the host's; a gateway or API that the flood starved would
    # be many times slower.
    assert flood_fetch <= 4 * base_fetch + 1.0, (base_fetch, flood_fetch)
    assert flood_api <= 4 * base_api + 1.0, (base_api, flood_api)


HOLD_THREE = """
import socket, sys
held = [socket.create_connection(("api.test", PORT), timeout=30) for _ in range(2)]
try:
    third = socket.create_connection(("api.test", PORT), timeout=30)
    third.sendall(b"GET /hello HTTP/1.0\\r\\n\\r\\n")
    print("third:", third.recv(100)[:15])
except OSError as e:  # reset: at connect, send or receive, whichever comes first
    print("third:", type(e).__name__)
"""


def test_limits_bandwidth_and_connections(api: httpx.Client, upstream: Upstream, vms: list[str]) -> None:
    vm = schedule(api, egress="open", limits={"egressMbps": 8, "maxConnections": 2})
    vms.append(vm)
    n = 4 * 1024 * 1024  # 4.2 MB at 1 MB/s after a 1 MB burst: about 3.2 s, 1.3 MB/s on average
    out = sh(
        api,
        vm,
        f"curl -sS --max-time 120 -o /dev/null -w '%{{size_download}} %{{speed_download}}' "
        f"http://api.test:{upstream.http_port}/bytes/{n}",
    )
    size, speed = out["stdout"].split()
    assert int(size) == n
    # 8 Mbit/s = 1 MB/s, with a one-second burst: well under what this path does unlimited.
    assert float(speed) < 1.6e6, out
    api.put(
        f"/v1/runtime/vms/{vm}/files/content",
        params={"path": "hold.py"},
        content=HOLD_THREE.replace("PORT", str(upstream.http_port)),
    )
    out = sh(api, vm, "python3 hold.py")
    assert out["stdout"].strip() in ("third: ConnectionResetError", "third: BrokenPipeError"), out
    wait_for_denied(api, vm, lambda e: e["details"]["rule"] == "maxConnections (2)")
