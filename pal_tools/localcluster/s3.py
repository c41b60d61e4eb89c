"""A real S3-compatible server on loopback: moto's standalone server as a subprocess (a
dev dependency: ``pip install 'moto[server]'``). For the tests, `pal bench cluster` and the
cluster demo; production points S3_ENDPOINT at AWS, MinIO or any S3.

Not an in-process mock: the code under test talks HTTP to another process, so timeouts,
connection refusals and server restarts behave as with MinIO or AWS.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Self

from pal_tools.localcluster.throwaway import ThrowawayServer, free_port

# Credentials the S3 client reads from the environment; moto accepts any.
TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "pal-test",
    "AWS_SECRET_ACCESS_KEY": "pal-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _moto_server_bin() -> str:
    # Next to the interpreter running pytest (the venv), else on PATH.
    candidate = Path(sys.executable).with_name("moto_server")
    found = str(candidate) if candidate.exists() else shutil.which("moto_server")
    if not found:
        raise RuntimeError("moto_server not found: pip install 'moto[server]'")
    return found


class S3Server(ThrowawayServer):
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> Self:
        # Own process group, so stop() can kill exactly this server and its children.
        self._proc = subprocess.Popen(
            [_moto_server_bin(), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self._proc.returncode}")
            try:
                with urllib.request.urlopen(self.endpoint + "/", timeout=1):
                    return self
            except urllib.error.HTTPError:
                return self  # it answered, even if with an error status
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto_server did not answer on {self.endpoint} within {timeout}s")

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
        except ProcessLookupError:
            proc.wait(timeout=5)
