"""The systemd files under deploy/ as systemd reads them: every value of the env examples
is what it looks like (systemd keeps a trailing "# comment" as part of the value), and the
variables the units use are defined and make a configuration Pal accepts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pal.config import Settings
from pal.server import advertised_url

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def systemd_environment(path: Path) -> dict[str, str]:
    """``EnvironmentFile=`` as systemd.exec(5) reads it: blank lines and lines starting with
    ``#`` or ``;`` are comments; elsewhere ``KEY=VALUE`` with the whitespace around the value
    dropped and nothing else: a ``#`` later in the line belongs to the value."""
    env = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, value = line.partition("=")
        assert sep and KEY.match(key.strip()), f"{path.name}:{n}: not KEY=VALUE: {raw!r}"
        env[key.strip()] = value.strip()
    return env


def unit_variables(unit: Path) -> tuple[str, set[str]]:
    """The unit's EnvironmentFile name and the ${VARS} its ExecStart expands."""
    text = unit.read_text()
    env_file = re.search(r"^EnvironmentFile=(.+)$", text, re.M)
    exec_start = re.search(r"^ExecStart=(.+)$", text, re.M)
    assert env_file and exec_start
    return Path(env_file.group(1).strip()).name, set(re.findall(r"\$\{(\w+)\}", exec_start.group(1)))


@pytest.mark.parametrize("example", ["server.env.example", "node.env.example"])
def test_env_examples_carry_no_comment_inside_a_value(example: str) -> None:
    env = systemd_environment(DEPLOY / example)
    assert env
    for key, value in env.items():
        assert "#" not in value, f"{example}: {key}={value!r}: a comment here becomes part of the value"
        assert not re.search(r"\s", value), f"{example}: {key}={value!r}: whitespace inside a value"


UNITS = [("pal-server.service", "server.env.example"), ("pal-node.service", "node.env.example")]


@pytest.mark.parametrize(("unit", "example"), UNITS)
def test_units_expand_only_variables_their_env_file_defines(unit: str, example: str) -> None:
    env_name, used = unit_variables(DEPLOY / unit)
    assert env_name == example.removesuffix(".example")
    assert used <= set(systemd_environment(DEPLOY / example))


def test_the_server_example_is_a_replica_configuration_pal_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    env = systemd_environment(DEPLOY / "server.env.example")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = Settings.from_env()
    assert settings.database_url and settings.database_url.startswith("postgresql://")
    # One secrets key for every replica: VM secrets and tenant CA keys in the store open anywhere.
    assert settings.secrets_key_path == Path("/etc/pal/secrets.key")
    assert advertised_url(env["PAL_LISTEN_HOST"], 8080, env["PAL_ADVERTISE_URL"]) == "http://10.0.0.11:8080"


def test_the_node_example_is_a_node_configuration_pal_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    env = systemd_environment(DEPLOY / "node.env.example")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    settings = Settings.from_env()
    assert settings.node_name == "node-a" and settings.node_labels == {"disk": "nvme"}
    assert settings.servers == ["http://10.0.0.11:8080", "http://10.0.0.12:8080"]
    assert settings.snapshot_key_path == Path("/etc/pal/snapshot.key")
    assert settings.s3_enabled
