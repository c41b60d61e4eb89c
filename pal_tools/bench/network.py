"""`pal bench network`: the network path measured end to end, in one run.

Starts its own `pal up` (names bench.test -> a server on 127.0.0.2, the only internal
address opened) and measures, through the public API and the node's own files:
- download throughput into the guest (curl, 3 runs) vs the same guest's in-memory pipe
  (`dd if=/dev/zero bs=64k | dd of=/dev/null`): target >= 50 %;
- connection setup (connect + request + first response byte, p50/p90 of N): the same
  Python client in the guest (through the gateway) and on the host (direct), plus the
  gateway's own share (accept -> upstream connected, timed inside the gateway): target
  <= 5 ms p50 added by the gateway;
- the gateway's CPU seconds per GiB relayed;
- how fast a refused destination fails (denied name, denied address);
- the per-VM namespace set-up: in-process (what Pal does) vs `ip`/`nft` subprocesses;
- ports: time to first byte of a request through ``/v1/runtime/vms/{id}/ports/{port}/`` from
  the host vs the same request made inside the guest, for a server on 0.0.0.0 (the node
  connects through the VM's namespace) and one on 127.0.0.1 (through the harness's relay),
  and their download throughput, beside the files API's (the virtio-serial channel, the
  other way a relay could have gone);
- brokered secrets: the latency of an HTTPS request whose secret the gateway inserts (TLS
  terminated and re-made by the gateway) against a pass-through HTTPS request to the same
  kind of server, from the same guest client, and the download throughput of both (the
  brokered one searched for reflected values, redact.py);
- the SNI/Host checks (namecheck.py): the same clients in a VM allowed by name (every
  request's Host and the SNI checked) against a VM with ``open`` egress (nothing checked),
  alternated in the same run; and the response redaction's own CPU per GiB, against the
  gateway's whole relay CPU per GiB of the same run.
Writes JSON and docs/benchmarks/network.md. Every target destination is on loopback.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import http.server
import json
import os
import shutil
import socket
import socketserver
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from pal.sizes import DEFAULT_MEMORY_MIB
from pal_tools.bench.common import Api, machine, pct
from pal_tools.bench.server import local_server, server_accel, wait_template

HOST = "127.0.0.2"
NAME = "bench.test"
BLOCK = bytes(range(256)) * 256  # 64 KiB

SETUP_CLIENT = """
import json, socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
req = b"GET /hello HTTP/1.0\\r\\nHost: bench.test\\r\\n\\r\\n"
out = []
for _ in range(n + 3):
    t = time.perf_counter()
    s = socket.create_connection((host, port), timeout=30)
    s.sendall(req)
    s.recv(1)
    out.append((time.perf_counter() - t) * 1000)
    s.close()
print(json.dumps(out[3:]))
"""

REFUSAL_CLIENT = """
import json, socket, time
def t(f):
    a = time.perf_counter()
    try:
        f()
        ok = True
    except OSError:
        ok = False
    return ok, (time.perf_counter() - a) * 1000
def name():
    socket.getaddrinfo("denied.bench.test", 80)
def addr():
    s = socket.create_connection(("203.0.113.7", 80), timeout=30)
    s.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
    if not s.recv(1):
        raise OSError("closed")
out = {"name": [t(name) for _ in range(5)], "address": [t(addr) for _ in range(5)]}
print(json.dumps(out))
"""


# In the guest: the same tiny server on 0.0.0.0:8000 and 127.0.0.1:8001 (/hello, /bytes/N),
# and a client timing connect + request + first byte against it from inside.
GUEST_SERVER = r"""
import http.server, socketserver, threading
BLOCK = bytes(range(256)) * 256
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def do_GET(self):
        n = int(self.path.rsplit("/", 1)[1]) if self.path.startswith("/bytes/") else 6
        self.send_response(200)
        self.send_header("Content-Length", str(n))
        self.end_headers()
        if not self.path.startswith("/bytes/"):
            self.wfile.write(b"hello\n")
            return
        left = n
        while left > 0:
            k = min(left, len(BLOCK))
            self.wfile.write(BLOCK[:k])
            left -= k
class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
for addr in (("0.0.0.0", 8000), ("127.0.0.1", 8001)):
    threading.Thread(target=S(addr, H).serve_forever, daemon=True).start()
threading.Event().wait()
"""
GUEST_TTFB = """
import json, socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
out = []
for _ in range(n + 3):
    t = time.perf_counter()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"GET /hello HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n")
    s.recv(1)
    out.append((time.perf_counter() - t) * 1000)
    s.close()
print(json.dumps(out[3:]))
"""


BROKERED_NAME = "brokered.bench.test"
PASS_NAME = "tls.bench.test"
# In the guest: N sequential HTTPS GETs, each a new connection (connect + TLS + request +
# response), timed; the CA file holds the bench server's CA and the tenant CA.
GUEST_HTTPS = """
import json, ssl, sys, time, urllib.request
url, n = sys.argv[1], int(sys.argv[2])
ctx = ssl.create_default_context(cafile="both.pem")
out = []
for _ in range(n + 3):
    t = time.perf_counter()
    req = urllib.request.Request(url, headers={"Authorization": "Bearer " + sys.argv[3]})
    urllib.request.urlopen(req, context=ctx, timeout=60).read()
    out.append((time.perf_counter() - t) * 1000)
print(json.dumps(out[3:]))
"""


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, *_: object) -> None:
        pass

    def do_GET(self) -> None:
        if self.path.startswith("/bytes/"):
            n = int(self.path.rsplit("/", 1)[1])
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.end_headers()
            left = n
            while left > 0:
                k = min(left, len(BLOCK))
                self.wfile.write(BLOCK[:k])
                left -= k
        else:
            body = b"hello\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # clients that hang up early (resets are part of the tests) are not errors


def _sh(api: Api, vm: str, line: str) -> dict[str, Any]:
    out = api.call(
        "POST",
        f"/v1/runtime/vms/{vm}/exec",
        json={"command": "/bin/sh", "argv": ["-c", line], "timeoutSecs": 600},
    )
    if out["exitCode"] != 0:
        raise RuntimeError(f"{line!r} failed in {vm}: {out}")
    return dict(out)


def _gateway_pid(data_dir: Path) -> int:
    return int((data_dir / "run" / "gateway.pid").read_text())


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _gateway_call(data_dir: Path, msg: dict[str, Any]) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(data_dir / "run" / "gateway.sock"))
        s.sendall(json.dumps(msg).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            buf += chunk
    return dict(json.loads(buf))


def _netns_setup(iterations: int) -> dict[str, list[float]]:
    """Pal's in-process namespace set-up vs the same with `ip` and `nft` subprocesses."""
    from pal.network import netns, nft

    out: dict[str, list[float]] = {"inprocess": [], "subprocess": []}
    tag = f"bench{os.getpid() % 100000}"
    rules = nft.ruleset(tap="tap0", guest_net=netns.GUEST_NET, gateway_port=netns.GATEWAY_PORT, dns_port=53)
    for i in range(iterations):
        name = netns.ns_name(tag, f"vm-{i}")
        t = time.perf_counter()
        ns = netns.create(name)
        out["inprocess"].append((time.perf_counter() - t) * 1000)
        ns.close_fds()
        netns.delete(name)
        t = time.perf_counter()
        for cmd in (
            ["ip", "netns", "add", name],
            ["ip", "-n", name, "link", "set", "lo", "up"],
            ["ip", "-n", name, "tuntap", "add", "dev", "tap0", "mode", "tap"],
            ["ip", "-n", name, "addr", "add", f"{netns.HOST_IP}/{netns.PREFIX}", "dev", "tap0"],
            ["ip", "-n", name, "link", "set", "tap0", "address", netns.HOST_MAC, "up"],
        ):
            subprocess.run(cmd, check=True, capture_output=True)
        subprocess.run(["ip", "netns", "exec", name, "nft", "-f", "-"], input=rules.encode(), check=True)
        out["subprocess"].append((time.perf_counter() - t) * 1000)
        subprocess.run(["ip", "netns", "del", name], check=True, capture_output=True)
    return out


def _mbps(text: str) -> float:
    """dd's or curl's rate in MB/s (10^6 bytes)."""
    line = text.strip().splitlines()[-1]
    if "copied" in line:  # dd: "... bytes (...) copied, 2.1 s, 49.9 MB/s"
        value, unit = line.rsplit(",", 1)[1].split()
        scale = {"kB/s": 1e-3, "MB/s": 1.0, "GB/s": 1e3, "B/s": 1e-6}[unit]
        return float(value) * scale
    return float(line) / 1e6  # curl -w %{speed_download}: bytes/s


def run(api: Api, data_dir: Path, port: int, iterations: int, size_mib: int, log: Any) -> dict[str, Any]:
    res: dict[str, Any] = {}
    vm = api.call("POST", "/v1/runtime/schedule", json={"egress": "open"})["vmId"]
    try:
        _sh(api, vm, f"curl -sS -o /dev/null http://{NAME}:{port}/bytes/1048576")  # warm TCG and caches
        n = size_mib * 1024 * 1024
        log(f"download {size_mib} MiB x3 and the guest's own pipe x3")
        gw = _gateway_pid(data_dir)
        cpu0 = _cpu_s(gw)
        dl = []
        for _ in range(3):
            out = _sh(
                api, vm, f"curl -sS -o /dev/null -w '%{{speed_download}}' http://{NAME}:{port}/bytes/{n}"
            )
            dl.append(_mbps(out["stdout"]))
        cpu = _cpu_s(gw) - cpu0
        pipe = []
        for _ in range(3):
            out = _sh(
                api,
                vm,
                f"dd if=/dev/zero bs=64k count={n // 65536} 2>/dev/null | dd of=/dev/null bs=64k 2>&1",
            )
            pipe.append(_mbps(out["stdout"]))
        res["download_mbs"] = dl
        res["pipe_mbs"] = pipe
        res["download_ratio"] = statistics.median(dl) / statistics.median(pipe)
        res["gateway_cpu_s_per_gib"] = cpu / (3 * n / 2**30)
        log(f"connection setup x{iterations}: guest via gateway, host direct")
        api.call(
            "PUT", f"/v1/runtime/vms/{vm}/files/content", params={"path": "setup.py"}, content=SETUP_CLIENT
        )
        out = _sh(api, vm, f"python3 setup.py {NAME} {port} {iterations}")
        res["setup_guest_ms"] = json.loads(out["stdout"])
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(SETUP_CLIENT)
        try:
            host = subprocess.run(
                ["python3", f.name, HOST, str(port), str(iterations)],
                check=True,
                capture_output=True,
                text=True,
            )
        finally:
            os.unlink(f.name)
        res["setup_host_ms"] = json.loads(host.stdout)
        res["setup_gateway_ms"] = _gateway_call(data_dir, {"op": "timings", "vmId": vm}).get("setupMs", [])[
            -iterations:
        ]
    finally:
        api.call("DELETE", f"/v1/runtime/vms/{vm}")
    log("refusals: a denied name, a denied address")
    vm = api.call("POST", "/v1/runtime/schedule", json={"egress": {"allow": [f"{NAME}:{port}"]}})["vmId"]
    try:
        api.call(
            "PUT", f"/v1/runtime/vms/{vm}/files/content", params={"path": "r.py"}, content=REFUSAL_CLIENT
        )
        out = json.loads(_sh(api, vm, "python3 r.py")["stdout"])
        if any(ok for ok, _ in out["name"] + out["address"]):
            raise RuntimeError(f"a refused destination connected: {out}")
        res["refusal_name_ms"] = [ms for _, ms in out["name"]]
        res["refusal_address_ms"] = [ms for _, ms in out["address"]]
    finally:
        api.call("DELETE", f"/v1/runtime/vms/{vm}")
    log("namespace set-up x20: in-process vs ip/nft subprocesses")
    res["netns_ms"] = _netns_setup(20)
    log(f"ports: time to first byte x{iterations} and throughput, direct and through the relay")
    res["ports"] = _ports(api, iterations, size_mib)
    return res


def _ports(api: Api, iterations: int, size_mib: int) -> dict[str, Any]:
    """Through /ports/ from the host vs inside the guest; 0.0.0.0 (direct) and 127.0.0.1 (relay)."""
    out: dict[str, Any] = {}
    vm = api.call("POST", "/v1/runtime/schedule", json={})["vmId"]
    try:
        api.call(
            "PUT", f"/v1/runtime/vms/{vm}/files/content", params={"path": "srv.py"}, content=GUEST_SERVER
        )
        api.call("PUT", f"/v1/runtime/vms/{vm}/files/content", params={"path": "ttfb.py"}, content=GUEST_TTFB)
        _sh(api, vm, "setsid python3 srv.py >/dev/null 2>&1 </dev/null & echo")
        deadline = time.time() + 300
        for port in (8000, 8001):
            while api.http.get(f"/v1/runtime/vms/{vm}/ports/{port}/hello").status_code != 200:
                if time.time() > deadline:
                    raise RuntimeError("the guest's bench server did not start")
                time.sleep(0.2)
        n = size_mib * 1024 * 1024
        for port, route in ((8000, "direct"), (8001, "relay")):
            ttfb = []
            for _ in range(iterations + 3):
                t = time.perf_counter()
                with api.http.stream("GET", f"/v1/runtime/vms/{vm}/ports/{port}/hello") as r:
                    body = r.iter_raw()
                    next(body)
                    ttfb.append((time.perf_counter() - t) * 1000)
                    for _ in body:
                        pass
            out[f"ttfb_{route}_ms"] = ttfb[3:]
            out[f"guest_ttfb_{route}_ms"] = json.loads(
                _sh(api, vm, f"python3 ttfb.py {port} {iterations}")["stdout"]
            )
            t = time.perf_counter()
            with api.http.stream("GET", f"/v1/runtime/vms/{vm}/ports/{port}/bytes/{n}") as r:
                got = sum(len(c) for c in r.iter_raw())
            out[f"download_{route}_mbs"] = got / (time.perf_counter() - t) / 1e6
        _sh(api, vm, "head -c 1048576 /dev/urandom > /workspace/blob")
        t = time.perf_counter()
        for _ in range(8):
            api.http.get(f"/v1/runtime/vms/{vm}/files/content", params={"path": "blob"}).raise_for_status()
        out["files_api_mbs"] = 8 * 1048576 / (time.perf_counter() - t) / 1e6
        pipe = f"dd if=/dev/zero bs=64k count={n // 65536} 2>/dev/null | dd of=/dev/null bs=64k 2>&1"
        out["guest_pipe_mbs"] = _mbps(_sh(api, vm, pipe)["stdout"])
    finally:
        api.call("DELETE", f"/v1/runtime/vms/{vm}")
    return out


def render(report: dict[str, Any]) -> str:
    r = report["results"]
    m = report["machine"]

    def p(values: list[float], q: float) -> str:
        return f"{pct(values, q):.2f}"

    dl, pipe = statistics.median(r["download_mbs"]), statistics.median(r["pipe_mbs"])
    g, h, gw = r["setup_guest_ms"], r["setup_host_ms"], r["setup_gateway_ms"]
    added = pct(g, 0.5) - pct(h, 0.5)
    lines = [
        "# Network benchmark",
        "",
        f"Measured {report['date']} by `pal bench network` on {m['cpu']} ({m['cores']} cores), "
        f"{m['kernel']}, accelerator **{m['accel']}**, load average at start {report['load_start']}. "
        "All upstream traffic went to a server on 127.0.0.2.",
        "",
        "| measure | value | target |",
        "|---|---|---|",
        f"| Download into the guest (curl, {report['size_mib']} MiB, median of 3) | {dl:.1f} MB/s | |",
        f"| The guest's own pipe (`dd \\| dd`, median of 3) | {pipe:.1f} MB/s | |",
        f"| Download / pipe | **{r['download_ratio'] * 100:.0f} %** | ≥ 50 % |",
        f"| Connection setup, guest through the gateway, p50 / p90 | {p(g, 0.5)} / {p(g, 0.9)} ms | |",
        f"| Same client on the host, direct, p50 / p90 | {p(h, 0.5)} / {p(h, 0.9)} ms | |",
        f"| Added by the whole path (guest p50 − host p50) | {added:.2f} ms | |",
        f"| Of which in the gateway (accept → upstream connected), p50 / p90 | "
        f"**{p(gw, 0.5)}** / {p(gw, 0.9)} ms | ≤ 5 ms p50 |",
        f"| Gateway CPU per GiB relayed | {r['gateway_cpu_s_per_gib']:.2f} s | |",
        f"| A denied name fails after (p50) | {p(r['refusal_name_ms'], 0.5)} ms | < 1000 ms |",
        f"| A denied address is reset after (p50) | {p(r['refusal_address_ms'], 0.5)} ms | < 1000 ms |",
        f"| VM namespace set-up in-process (Pal), p50 / p90 | {p(r['netns_ms']['inprocess'], 0.5)} / "
        f"{p(r['netns_ms']['inprocess'], 0.9)} ms | |",
        f"| Same with `ip` + `nft` subprocesses, p50 / p90 | {p(r['netns_ms']['subprocess'], 0.5)} / "
        f"{p(r['netns_ms']['subprocess'], 0.9)} ms | |",
        "",
        f"Connection setup: {len(g)} connect + request + first byte of the response, by the same Python "
        "client in the guest and on the host. Under TCG the guest's own code (Python, its TCP stack, "
        "virtio) dominates the guest figure; the gateway's own share is timed inside the gateway.",
        "",
        *_ports_lines(r.get("ports"), p),
        *_brokered_lines(r.get("brokered"), p),
        *_checks_lines(r, p),
        "Raw figures: `network.json` next to this file.",
        "",
    ]
    return "\n".join(lines)


def _tls_servers(tmp: Path) -> dict[str, Any]:
    """Two HTTPS servers on 127.0.0.2 with certificates of a CA of their own."""
    import ssl

    from pal.network.ca import Issuer, new_ca

    ca, key = new_ca("bench-upstream")
    (tmp / "ca.pem").write_text(ca)
    issuer = Issuer(ca, key)
    out: dict[str, Any] = {"ca": ca, "servers": [], "ports": {}}
    for name in (BROKERED_NAME, PASS_NAME):
        chain, leaf_key = issuer.leaf(name)
        pem = tmp / f"{name}.pem"
        pem.write_text(chain + leaf_key)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(pem)
        srv = _Server((HOST, 0), _Handler)
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        out["servers"].append(srv)
        out["ports"][name] = int(srv.server_address[1])
    return out


def _download(api: Api, vm: str, url: str, extra: str = "") -> float:
    out = _sh(api, vm, f"curl -sS -o /dev/null -w '%{{speed_download}}' {extra} {url}")
    return _mbps(out["stdout"])


def _name_checks(api: Api, tls: dict[str, Any], port: int, iterations: int, size_mib: int) -> dict[str, Any]:
    """The same clients in an ``open`` VM (the baseline: nothing checked) and in a VM whose
    allow list names the servers (SNI and every Host checked), alternated."""
    tls_port = tls["ports"][PASS_NAME]
    specs = {
        "open": {"egress": "open"},
        "checked": {"egress": {"allow": [f"{NAME}:{port}", f"{PASS_NAME}:{tls_port}"]}},
    }
    vms = {k: api.call("POST", "/v1/runtime/schedule", json=spec)["vmId"] for k, spec in specs.items()}
    out: dict[str, dict[str, Any]] = {k: {"download_mbs": []} for k in vms}
    try:
        for vm in vms.values():
            files = (("setup.py", SETUP_CLIENT), ("https.py", GUEST_HTTPS), ("both.pem", tls["ca"]))
            for name, text in files:
                api.call("PUT", f"/v1/runtime/vms/{vm}/files/content", params={"path": name}, content=text)
            _sh(api, vm, f"curl -sS -o /dev/null http://{NAME}:{port}/bytes/1048576")  # warm up
        n = size_mib * 1024 * 1024
        for _ in range(3):
            for k, vm in vms.items():
                out[k]["download_mbs"].append(_download(api, vm, f"http://{NAME}:{port}/bytes/{n}"))
        for k, vm in vms.items():
            out[k]["setup_ms"] = json.loads(
                _sh(api, vm, f"python3 setup.py {NAME} {port} {iterations}")["stdout"]
            )
            url = f"https://{PASS_NAME}:{tls_port}/hello"
            out[k]["https_ms"] = json.loads(_sh(api, vm, f"python3 https.py {url} {iterations} x")["stdout"])
        return out
    finally:
        for vm in vms.values():
            api.call("DELETE", f"/v1/runtime/vms/{vm}")


def _redaction_cpu(size_mib: int) -> float:
    """CPU seconds per GiB of the response redaction alone (64 KiB pieces, one value)."""
    from pal.network.redact import Redactor, pairs_of

    r = Redactor(pairs_of([("bench-secret-value-0123456789", "pal-brokered-bench_key-x")]))
    n = max(1, size_mib // 4) * 1024 * 1024
    t = time.process_time()
    for _ in range(n // len(BLOCK)):
        r.feed(BLOCK)
    r.flush()
    return (time.process_time() - t) / (n / 2**30)


def _brokered(api: Api, tls: dict[str, Any], iterations: int, size_mib: int) -> dict[str, Any]:
    secret = {"value": "bench-secret", "brokered": {"hosts": [BROKERED_NAME], "header": "X-Bench-Key"}}
    vm = api.call("POST", "/v1/runtime/schedule", json={"secrets": {"BENCH_KEY": secret}})["vmId"]
    try:
        files = (("https.py", GUEST_HTTPS), ("bench-ca.pem", tls["ca"]))
        for name, text in files:
            api.call("PUT", f"/v1/runtime/vms/{vm}/files/content", params={"path": name}, content=text)
        _sh(api, vm, "cat bench-ca.pem /etc/ssl/certs/pal-brokered-ca.pem > both.pem")
        out: dict[str, Any] = {"brokered_download_mbs": [], "passthrough_download_mbs": []}
        for name, label in ((BROKERED_NAME, "brokered_ms"), (PASS_NAME, "passthrough_ms")):
            url = f"https://{name}:{tls['ports'][name]}/hello"
            got = _sh(api, vm, f'python3 https.py {url} {iterations} "$BENCH_KEY"')["stdout"]
            out[label] = json.loads(got)
        n = size_mib * 1024 * 1024
        for _ in range(3):  # the brokered body is searched for the value as it streams
            for name, label in ((BROKERED_NAME, "brokered"), (PASS_NAME, "passthrough")):
                url = f"https://{name}:{tls['ports'][name]}/bytes/{n}"
                out[f"{label}_download_mbs"].append(_download(api, vm, url, "--cacert both.pem"))
        return out
    finally:
        api.call("DELETE", f"/v1/runtime/vms/{vm}")


def _brokered_lines(b: dict[str, Any] | None, p: Any) -> list[str]:
    if not b:
        return []
    br, pt = b["brokered_ms"], b["passthrough_ms"]
    downloads = []
    if b.get("brokered_download_mbs"):
        bd, pd = (
            statistics.median(b["brokered_download_mbs"]),
            statistics.median(b["passthrough_download_mbs"]),
        )
        downloads = [
            f"| download (curl, median of 3): brokered / passed through | "
            f"{bd:.1f} / {pd:.1f} MB/s, {bd / pd:.2f}× |"
        ]
    return [
        "## Brokered secrets",
        "",
        "An HTTPS GET from the guest (Python, a new connection each: connect, TLS, request, "
        "response) to a server on 127.0.0.2 whose name has a brokered secret (the gateway "
        "terminates TLS with a leaf of the tenant CA, puts the secret in a header, and makes its "
        "own verified TLS connection upstream) against the same request to a server whose "
        "TLS passes through untouched.",
        "",
        "| request | p50 / p90 |",
        "|---|---|",
        f"| brokered | {p(br, 0.5)} / {p(br, 0.9)} ms |",
        f"| passed through | {p(pt, 0.5)} / {p(pt, 0.9)} ms |",
        f"| added by brokering (p50 − p50), ratio | {pct(br, 0.5) - pct(pt, 0.5):.2f} ms, "
        f"{pct(br, 0.5) / pct(pt, 0.5):.2f}× |",
        *downloads,
        "",
    ]


def _checks_lines(r: dict[str, Any], p: Any) -> list[str]:
    c = r.get("name_checks")
    if not c:
        return []
    o, k = c["open"], c["checked"]
    lines = [
        "## SNI/Host checks and response redaction",
        "",
        "The same guest clients in a VM whose allow list names the servers (each request's `Host` "
        "and each TLS SNI checked, namecheck.py) against a VM with `open` egress (nothing checked), "
        "alternated in the same run. The redaction (redact.py) searches every brokered response "
        "body for the values put in: its CPU alone, on the host, against the gateway's whole relay "
        "CPU per GiB measured above.",
        "",
        "| measure | open (baseline) | checked | ratio |",
        "|---|---|---|---|",
    ]
    for key, what in (("setup_ms", "HTTP connection setup p50"), ("https_ms", "HTTPS request p50")):
        a, b = pct(o[key], 0.5), pct(k[key], 0.5)
        lines.append(f"| {what} | {a:.2f} ms | {b:.2f} ms | **{b / a:.2f}×** |")
    a, b = statistics.median(o["download_mbs"]), statistics.median(k["download_mbs"])
    lines.append(f"| download (median of 3) | {a:.1f} MB/s | {b:.1f} MB/s | **{b / a:.2f}×** |")
    if r.get("redaction_cpu_s_per_gib") is not None:
        red, relay = r["redaction_cpu_s_per_gib"], r["gateway_cpu_s_per_gib"]
        lines.append(
            f"| CPU per GiB: relay (baseline) / redaction | {relay:.2f} s | {red:.2f} s "
            f"| **{red / relay:.2f}×** |"
        )
    return [*lines, ""]


def _ports_lines(ports: dict[str, Any] | None, p: Any) -> list[str]:
    if not ports:
        return []
    lines = [
        "## Ports",
        "",
        "Time to first byte of `GET /hello` (connect + request + first response byte), from the host "
        "through `/v1/runtime/vms/{id}/ports/{port}/` (API → node → guest) against the same request "
        "made inside the guest to 127.0.0.1 (the baseline), and a download through the port.",
        "",
        "| server bound to | route | TTFB through the API p50 / p90 | in the guest p50 / p90 | ratio (p50) "
        "| download |",
        "|---|---|---|---|---|---|",
    ]
    for route, bound in (("direct", "0.0.0.0"), ("relay", "127.0.0.1")):
        a, g = ports[f"ttfb_{route}_ms"], ports[f"guest_ttfb_{route}_ms"]
        lines.append(
            f"| {bound} | {route} | {p(a, 0.5)} / {p(a, 0.9)} ms | {p(g, 0.5)} / {p(g, 0.9)} ms | "
            f"{pct(a, 0.5) / pct(g, 0.5):.1f}× | {ports[f'download_{route}_mbs']:.1f} MB/s |"
        )
    lines += [
        "",
        f"For comparison, the files API (1 MiB reads over the virtio-serial channel, the path a "
        f"harness-side relay over that channel would take): {ports['files_api_mbs']:.1f} MB/s; the "
        f"guest's own pipe: {ports['guest_pipe_mbs']:.1f} MB/s.",
        "",
    ]
    return lines


def main(iterations: int, size_mib: int, data_dir: Path | None, out_dir: Path) -> None:
    def log(msg: str) -> None:
        print(f"[bench network] {msg}", flush=True)

    server = _Server((HOST, 0), _Handler)
    port = int(server.server_address[1])
    threading.Thread(target=server.serve_forever, daemon=True).start()
    load = os.getloadavg()
    tls_dir = Path(tempfile.mkdtemp(prefix="pal-bench-tls-"))
    tls = _tls_servers(tls_dir)
    env = {
        "PAL_EGRESS_RESOLVE": f"{NAME}={HOST},{BROKERED_NAME}={HOST},{PASS_NAME}={HOST}",
        "PAL_EGRESS_ALLOW_INTERNAL": HOST,
        "PAL_EGRESS_DNS": "static",  # no lookup leaves the machine
        "PAL_IDLE_SWEEP_INTERVAL": "1",
        "PAL_EGRESS_CA_BUNDLE": str(tls_dir / "ca.pem"),
    }
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, tls_dir, True)
        for srv in tls["servers"]:
            stack.callback(srv.shutdown)
        if data_dir is None:
            data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pal-bench-net-")))
            os.chmod(data_dir, 0o700)
        url, key = stack.enter_context(local_server(data_dir, env))
        api = Api(url, key)
        log("waiting for the warm template")
        wait_template(api, DEFAULT_MEMORY_MIB)
        results = run(api, data_dir, port, iterations, size_mib, log)
        log(f"brokered secrets: {iterations} HTTPS requests brokered and passed through")
        results["brokered"] = _brokered(api, tls, iterations, size_mib)
        log(f"SNI/Host checks: open vs allowed by name, x{iterations}, and the redaction's CPU")
        results["name_checks"] = _name_checks(api, tls, port, iterations, size_mib)
        results["redaction_cpu_s_per_gib"] = _redaction_cpu(size_mib)
        info = machine()
        info["accel"] = server_accel(url)
    server.shutdown()
    report = {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": info,
        "load_start": " ".join(f"{x:.2f}" for x in load),
        "size_mib": size_mib,
        "iterations": iterations,
        "results": results,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "network.json").write_text(json.dumps(report, indent=2))
    (out_dir / "network.md").write_text(render(report))
    print(render(report))
