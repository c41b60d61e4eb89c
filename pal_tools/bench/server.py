"""The `pal up` a benchmark starts for itself (unless given a URL), and waiting for its
templates."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from pal.ops.progress import Steps
from pal.sizes import size_name
from pal_tools.bench.common import Api, report_of
from pal_tools.localcluster.throwaway import free_port

# The operator token of the servers this process starts: /healthz names the accelerator
# only to the operator (a remote server's comes from PAL_ADMIN_TOKEN).
OPERATOR_TOKEN = secrets.token_urlsafe(24)


def server_accel(url: str, token: str | None = None) -> str:
    """The accelerator the server at ``url`` runs its VMs on ("unknown" without the token)."""
    token = token or os.environ.get("PAL_ADMIN_TOKEN") or OPERATOR_TOKEN
    r = httpx.get(url + "/healthz", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    return str(r.json().get("accel", "unknown"))


def measure_on_local_server(
    data_dir: Path | None,
    measure: Callable[[Api, Path], dict[str, Any]],
    extra_env: dict[str, str] | None = None,
    max_vms: int = 200,
) -> dict[str, Any]:
    """What ``measure(api, data_dir)`` returns, measured against a `pal up` of its own on
    ``data_dir`` (default PAL_DATA_DIR) by a tenant allowed ``max_vms``, as a report
    (common.report_of: the machine, the accelerator, the load before and after)."""
    from pal.config import Settings

    data = data_dir or Settings.from_env().data_dir
    load_start = os.getloadavg()[0]
    with local_server(data, extra_env, max_vms) as (url, key):
        accel = server_accel(url)
        body = measure(Api(url, key), data)
    return report_of(body, accel=accel, load_start=load_start, data_dir=data)


@contextlib.contextmanager
def local_server(
    data_dir: Path, extra_env: dict[str, str] | None = None, max_vms: int = 200
) -> Iterator[tuple[str, str]]:
    """A `pal up` on ``data_dir`` and the key of a new tenant allowed ``max_vms`` VMs."""
    port, ports_port = free_port(), free_port()
    env = {
        **os.environ,
        "PAL_LOG_LEVEL": "WARNING",
        "PAL_ADMIN_TOKEN": OPERATOR_TOKEN,
        "PAL_PORTS_PORT": str(ports_port),  # beside whatever else runs here
        "PAL_E2B_PORT": str(free_port()),  # the E2B agent listener, likewise
        **(extra_env or {}),
    }
    pal = [sys.executable, "-m", "pal.cli.main"]
    proc = subprocess.Popen([*pal, "up", "--port", str(port), "--data-dir", str(data_dir)], env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 900
        with Steps(f"pal up for the benchmark ({data_dir})") as steps:
            steps("starting (image, network, adoption)", 0.1)
            while time.time() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                        break
                if proc.poll() is not None:
                    raise RuntimeError("pal up exited")
                time.sleep(0.5)
            name = f"bench-{os.getpid()}-{int(time.time())}"
            out = subprocess.run(
                [*pal, "tenants", "create", name, "--max-vms", str(max_vms), "--data-dir", str(data_dir)],
                check=True, capture_output=True, text=True, env=env,
            )  # fmt: skip
            # Measure at full speed: the default template is warm (what `pal up` logs as ready).
            steps("warming the default template (/readyz)", 0.5)
            while httpx.get(url + "/readyz", timeout=10).status_code != 200:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("pal up did not become ready (/readyz)")
                time.sleep(0.05)
            steps("ready", 1.0)
        yield url, json.loads(out.stdout)["apiKey"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()


def drop_default_template(data_dir: Path, memory_mib: int) -> None:
    """Remove the default image's template of the bench's size (the next `pal up` rebuilds it)."""
    import shutil

    from pal.config import Settings
    from pal.images.paths import load_image
    from pal.manager.templates import TemplateCache

    settings = Settings.from_env(data_dir)
    cache = TemplateCache.from_settings(settings)
    key = cache.key(load_image(settings, "default"), size_name(memory_mib, 1, 2048))
    shutil.rmtree(cache.root / key, ignore_errors=True)


def wait_image_template(api: Api, image: str, memory_mib: int, timeout: float = 600) -> None:
    """Poll GET /v1/images until ``image`` has a warm template of the bench's size."""
    deadline = time.time() + timeout
    want = size_name(memory_mib)  # the bench's VMs: default vCPUs and disk
    while time.time() < deadline:
        images = {i["name"]: i for i in api.call("GET", "/v1/images")["images"]}
        if want in images.get(image, {}).get("warmSizes", []):
            return
        time.sleep(0.5)
    raise RuntimeError(f"no warm template for image {image} after {timeout:.0f} s")


def wait_template(api: Api, memory_mib: int, timeout: float = 600) -> None:
    """Schedule until a VM comes up from the warm template (built in the background)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        vm = api.call("POST", "/v1/runtime/schedule", json={"limits": {"memoryMib": memory_mib}})
        api.call("DELETE", f"/v1/runtime/vms/{vm['vmId']}")
        if vm.get("bootMethod") == "template":
            return
        time.sleep(2)
