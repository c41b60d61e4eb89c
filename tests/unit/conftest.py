"""Fixtures shared by the unit tests."""

from tests.harnesshost import host, workspace  # noqa: F401 (the harness over a socketpair)
