"""Fixtures shared by the unit tests."""

import httpx

from tests.harnesshost import host, workspace  # noqa: F401 (the harness over a socketpair)

# No unit test bounds anything by wall-clock time, but an httpx client that is not told
# otherwise gives up on a read after 5 s: in CI the unit tests run beside the VM tests on
# two cores, and a schedule on the fake runtime took longer than that there (a ReadTimeout
# in test_link_sockets, and in test_api_sse the run before). Two minutes still ends a
# request that hangs.
for _client in (httpx.Client, httpx.AsyncClient):
    _client.__init__.__kwdefaults__["timeout"] = httpx.Timeout(120.0)
