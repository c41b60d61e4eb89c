"""The S3 server of the tests: pal_tools/localcluster/s3.py's moto server.

Use the session fixture ``s3_server`` (an :class:`S3Server`), or ``S3Server(port)`` as a
context manager when a test must start/stop a server itself (e.g. "server comes back").
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from pal_tools.localcluster.s3 import TEST_ENV, S3Server, free_port

__all__ = ["TEST_ENV", "S3Server", "free_port", "s3_server"]


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One moto server for the test session; AWS credentials set for its duration."""
    saved = {k: os.environ.get(k) for k in TEST_ENV}
    os.environ.update(TEST_ENV)
    try:
        with S3Server() as server:
            yield server
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
