"""The suite's preflight (scripts/test.sh runs it before the VM tests): one real VM scheduled
and exec'd on a `pal up` under the settings the suite will use (this environment's PAL_*,
as every test server inherits them). On a host where VMs cannot start the suite stops here,
within two minutes, with the reason and `pal doctor`'s verdict, instead of failing every VM
test one by one. Leaves nothing running: the server stops, its VMs with it.

    python -m tests.preflight        # exit 0: a VM ran; 1: it did not, and why
"""

from __future__ import annotations

import sys
import time

import httpx

from tests.conftest import pal_cli, prepare_base_dir, scratch_run_dir, start_server, stop_server

BUDGET_S = 110.0  # the whole preflight, server start included: under two minutes


def _vm_runs(url: str, key: str, deadline: float) -> str | None:
    """None when a VM was scheduled, ran `/bin/true` and was deleted; else what failed."""
    left = max(deadline - time.monotonic(), 1.0)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=left) as c:
        # Cold: a fresh machine's template is still being built (a schedule would wait for it).
        r = c.post("/v1/runtime/schedule", json={"boot": "cold"})
        if r.status_code != 200:
            return f"schedule answered {r.status_code}: {r.text[:2000]}"
        vm = r.json()["vmId"]
        try:
            out = c.post(
                f"/v1/runtime/vms/{vm}/exec",
                json={"command": "/bin/true"},
                timeout=max(deadline - time.monotonic(), 1.0),
            )
            if out.status_code != 200 or out.json().get("exitCode") != 0:
                return f"exec in {vm} answered {out.status_code}: {out.text[:2000]}"
        finally:
            c.delete(f"/v1/runtime/vms/{vm}")
    return None


def main() -> int:
    t0 = time.monotonic()
    deadline = t0 + BUDGET_S
    prepare_base_dir()
    with scratch_run_dir("preflight") as run_dir:
        server = None
        try:
            server = start_server(run_dir, healthy=False, within_s=BUDGET_S / 2)
            key = server.tenant("preflight", max_vms=1)
            why = _vm_runs(server.url, key, deadline)
        except Exception as exc:  # the server did not come up, or a request timed out
            why = f"{type(exc).__name__}: {exc}"
        if why is None:
            print(f"preflight: a VM was scheduled and ran a command in {time.monotonic() - t0:.0f} s")
            assert server is not None
            stop_server(server)
            return 0
        took = time.monotonic() - t0
        print(f"preflight FAILED after {took:.0f} s: no VM ran on this host under the suite's settings")
        print(f"  {why}")
        if server is not None:
            print(f"--- the server's log (tail)\n{server.log_tail(30)}")
        # The server's own view when it answers; else this shell's (port 1: no server).
        url = server.url if server is not None else "http://127.0.0.1:1"
        doctor = pal_cli("doctor", "--url", url, "--data-dir", str(run_dir), check=False)
        print(f"--- pal doctor (exit {doctor.returncode})\n{doctor.stdout}{doctor.stderr}")
        if server is not None:
            stop_server(server)
        return 1


if __name__ == "__main__":
    sys.exit(main())
