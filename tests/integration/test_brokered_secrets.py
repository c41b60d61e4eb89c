"""Issue 11, brokered secrets: a credential the guest can use but never sees.

A real VM, a local HTTPS server with its own CA on 127.0.0.2 (tests/netservers.py; the
session's server trusts that CA through PAL_EGRESS_CA_BUNDLE). The real values appear
only in this test process and in the host's gateway: the test searches the guest's
environment, a pause snapshot's files, the server's log and its database for them.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.conftest import PalServer
from tests.leaks import vm_dir_of
from tests.netservers import Upstream

pytestmark = pytest.mark.vm


def sh(api: httpx.Client, vm: str, line: str) -> dict:
    r = api.post(f"/v1/runtime/vms/{vm}/exec", json={"command": "/bin/sh", "argv": ["-c", line]})
    assert r.status_code == 200, r.text
    return r.json()


def digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:16]


def files_containing(paths: list[Path], needles: list[str]) -> list[str]:
    """Files among ``paths`` holding any needle (grep reads sparse files' holes fast)."""
    files = [str(p) for p in paths if p.is_file()]
    out = subprocess.run(
        ["grep", "-a", "-l", "-F", *[x for n in needles for x in ("-e", n)], *files],
        capture_output=True,
        text=True,
    )
    assert out.returncode in (0, 1), out.stderr
    return out.stdout.split()


def test_brokered_secret_reaches_only_its_host_and_never_the_guest(
    pal_server: PalServer, api: httpx.Client, upstream: Upstream
) -> None:
    real = "sk-real-" + secrets.token_hex(16)
    rotated = "sk-rotated-" + secrets.token_hex(16)
    port = upstream.tls_port
    spec = {
        "secrets": {
            "OPENAI_API_KEY": {
                "value": real,
                "brokered": {"hosts": ["api.test"], "header": "Authorization", "format": "Bearer {value}"},
            },
            "PLAIN": "plain-value",
        }
    }
    r = api.post("/v1/runtime/schedule", json=spec)
    assert r.status_code == 200, r.text
    vm = r.json()["vmId"]
    try:
        ca = upstream.ca_pem
        api.put(f"/v1/runtime/vms/{vm}/files/content", params={"path": "test-ca.pem"}, content=ca)
        # curl with the system trust store (which holds the tenant CA), Python with
        # SSL_CERT_FILE; the other host is passed through untouched (its own certificate).
        # The test server answers digests of the headers it got and keeps the headers for us:
        # its answer must not carry the value into the guest.
        n0 = len(upstream.received)
        out = sh(
            api,
            vm,
            f"curl -sS --max-time 60 https://api.test:{port}/headers; echo; "
            "python3 -c 'import urllib.request,sys; "
            f'sys.stdout.write(urllib.request.urlopen("https://api.test:{port}/headers").read().decode())\'; '
            f'echo; curl -sS --max-time 60 --cacert test-ca.pem -H "Authorization: Bearer $OPENAI_API_KEY" '
            f'-H "X-Key: $OPENAI_API_KEY" https://other.test:{port}/headers; echo; '
            'echo "$OPENAI_API_KEY"; echo "$PLAIN"; '
            'echo "$SSL_CERT_FILE $REQUESTS_CA_BUNDLE $NODE_EXTRA_CA_CERTS"',
        )
        assert out["exitCode"] == 0, out
        lines = out["stdout"].splitlines()
        via_curl, via_python, other = (json.loads(x) for x in lines[:3])
        placeholder, plain, ca_env = lines[3], lines[4], lines[5]
        got = upstream.received[n0:]
        assert len(got) == 3
        assert got[0]["Authorization"] == got[1]["Authorization"] == f"Bearer {real}"
        assert via_curl["Authorization"] == via_python["Authorization"] == digest(f"Bearer {real}")
        # Another allowed host: the placeholder, in every header, never the value.
        assert placeholder.startswith("pal-brokered-openai_api_key-") and real not in placeholder
        assert got[2]["Authorization"] == f"Bearer {placeholder}" and got[2]["X-Key"] == placeholder
        assert other["Authorization"] == digest(f"Bearer {placeholder}")
        assert plain == "plain-value"
        assert ca_env == (
            "/etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt "
            "/etc/ssl/certs/pal-brokered-ca.pem"
        )

        # Nowhere in the guest's processes' environments.
        env = sh(api, vm, "cat /proc/[0-9]*/environ 2>/dev/null | tr '\\0' '\\n' | sort -u")["stdout"]
        assert placeholder in env and real not in env
        # Nor in the running VM's files on the host: its config drive, disk and RAM.
        vm_files = [p for p in (vm_dir_of(pal_server.data_dir, vm)).rglob("*") if p.is_file()]
        assert any(p.name == "config.img" for p in vm_files), vm_files
        assert files_containing(vm_files, [placeholder]), "the search finds what is there"
        assert files_containing(vm_files, [real]) == []

        # Rotation: the next request carries the new value; the guest is not touched.
        r = api.put(f"/v1/runtime/vms/{vm}/secrets/OPENAI_API_KEY", json={"value": rotated})
        assert r.status_code == 200 and r.json() == {"name": "OPENAI_API_KEY", "applied": "now"}, r.text
        out = sh(api, vm, f"curl -sS --max-time 60 https://api.test:{port}/headers")
        assert out["exitCode"] == 0, out
        assert upstream.received[-1]["Authorization"] == f"Bearer {rotated}"
        assert files_containing(vm_files, [real, rotated]) == []  # the node's record is sealed
        assert api.put(f"/v1/runtime/vms/{vm}/secrets/PLAIN", json={"value": "x"}).status_code == 400
        assert api.put(f"/v1/runtime/vms/{vm}/secrets/NOPE", json={"value": "x"}).status_code == 404

        # A pause snapshot's memory and disk hold neither value (the placeholder, yes).
        assert api.post(f"/v1/runtime/vms/{vm}/pause").status_code == 200
        snaps = list(pal_server.data_dir.glob(f"snapshots/*/{vm}/*/*"))
        assert {p.name for p in snaps} >= {"mem", "rootfs"}, snaps
        assert files_containing(snaps, [placeholder]), "the search finds what is there"
        assert files_containing(snaps, [real, rotated]) == []
        # Nor do the server's log, its database files, and the log of the egress gateway
        # (the one process that holds the value, to put it into requests).
        db_files = list(pal_server.data_dir.glob("pal.db*"))
        gateway_log = pal_server.data_dir / "run" / "gateway.log"
        assert db_files and gateway_log.is_file(), (db_files, gateway_log)
        logs = [*db_files, pal_server.log_path, gateway_log]
        assert files_containing(logs, [real, rotated]) == []

        # Resumed from that snapshot, the VM's requests are brokered again.
        assert api.post(f"/v1/runtime/vms/{vm}/resume").status_code == 200
        out = sh(api, vm, f"curl -sS --max-time 60 https://api.test:{port}/headers")
        assert out["exitCode"] == 0, out
        assert upstream.received[-1]["Authorization"] == f"Bearer {rotated}"
    finally:
        api.delete(f"/v1/runtime/vms/{vm}")


def test_bad_brokered_secrets_are_400(api: httpx.Client) -> None:
    for bad, why in (
        ({"value": "a\nb", "brokered": {"hosts": ["x.test"]}}, "no CR, LF"),
        ({"value": "v", "brokered": {"hosts": []}}, "hosts must list"),
        ({"value": "v", "brokered": {"hosts": ["10.0.0.1"]}}, "is not a domain"),
        ({"value": "v", "brokered": {"hosts": ["x.test"], "format": "Bearer"}}, "{value}"),
        ({"value": "v", "brokered": {"hosts": ["x.test"], "header": "Bad Header"}}, "header name"),
    ):
        r = api.post("/v1/runtime/schedule", json={"secrets": {"K": bad}})
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text
