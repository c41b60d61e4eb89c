"""A throwaway PostgreSQL server: Debian's ``initdb``/``pg_ctl`` in a directory of our own,
listening on 127.0.0.1 only, with a random password. No system service is touched.

PostgreSQL refuses to run as root, so when we are root the cluster is created and run as
the ``postgres`` user (Debian's package creates it) through ``runuser``.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Self

from pal.pids import pid_alive
from pal_tools.localcluster.throwaway import ThrowawayServer, free_port

# Debian keeps each major's programs in /usr/lib/postgresql/<major>/bin (not on PATH).
DEBIAN_BIN_GLOB = "/usr/lib/postgresql/*/bin"
FALLBACK_BIN_DIRS = ("/usr/local/bin", "/usr/bin")
RUN_AS = "postgres"
OWNER_FILE = "owner.pid"
PREFIX = "pal-pg-"


def _major(path: Path) -> tuple[int, ...]:
    """The PostgreSQL major of a Debian bin dir (``.../16/bin`` -> (16,)); () if not a number."""
    try:
        return tuple(int(part) for part in path.parent.name.split("."))
    except ValueError:
        return ()


def bin_dirs() -> list[Path]:
    """Where to look for initdb and pg_ctl: the newest installed Debian major first."""
    debian = sorted((Path(p) for p in glob.glob(DEBIAN_BIN_GLOB)), key=_major, reverse=True)
    return [*debian, *(Path(d) for d in FALLBACK_BIN_DIRS)]


def _bin(name: str) -> str:
    for d in bin_dirs():
        p = d / name
        if p.exists():
            return str(p)
    found = shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} not found: install Debian's postgresql package (scripts/install.sh)")
    return found


def reap_orphans() -> list[Path]:
    """Stop and remove the throwaway servers whose owning process is gone (only those that
    recorded an owner: a server of a live run, or of someone else, is never touched)."""
    reaped = []
    for base in Path(tempfile.gettempdir()).glob(PREFIX + "*"):
        try:
            owner = int((base / OWNER_FILE).read_text().strip())
        except (OSError, ValueError):
            continue
        if pid_alive(owner):
            continue
        cmd = [_bin("pg_ctl"), "-D", str(base / "data"), "-m", "immediate", "-w", "stop"]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", RUN_AS, "--", *cmd]
        subprocess.run(cmd, capture_output=True, timeout=60)
        shutil.rmtree(base, ignore_errors=True)
        reaped.append(base)
    return reaped


# A throwaway server for tests and demos: durability is not what it is for.
FAST_SETTINGS = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}


class LocalPostgres(ThrowawayServer):
    """``with LocalPostgres() as pg: pg.url`` -> a SQLAlchemy URL of an empty database.

    ``durable``: keep PostgreSQL's own defaults (fsync, synchronous commit, full page
    writes), as a benchmark of the control plane must; ``settings``: more ``-c`` settings
    (``shared_preload_libraries``, ``shared_buffers``...)."""

    def __init__(
        self,
        base_dir: Path | None = None,
        port: int | None = None,
        database: str = "pal",
        *,
        durable: bool = False,
        settings: dict[str, str] | None = None,
    ) -> None:
        self.port = port or free_port()
        self.database = database
        self.settings = {**({} if durable else FAST_SETTINGS), "max_connections": "200", **(settings or {})}
        self.password = secrets.token_urlsafe(18)
        self._own_base = base_dir is None
        self.base = Path(base_dir or tempfile.mkdtemp(prefix=PREFIX))
        self.data = self.base / "data"
        self.log = self.base / "postgres.log"
        self._started = False

    @property
    def url(self) -> str:
        return self.url_of(self.database)

    def _as_owner(self, argv: list[str]) -> list[str]:
        if os.geteuid() != 0:
            return argv
        return ["runuser", "-u", RUN_AS, "--", *argv]

    def _chown(self, path: Path) -> None:
        if os.geteuid() == 0:
            pw = pwd.getpwnam(RUN_AS)
            os.chown(path, pw.pw_uid, pw.pw_gid)

    def start(self, timeout: float = 60.0) -> Self:
        reap_orphans()
        self.base.mkdir(parents=True, exist_ok=True)
        os.chmod(self.base, 0o700)
        self._chown(self.base)
        pwfile = self.base / "pwfile"
        pwfile.write_text(self.password + "\n")
        os.chmod(pwfile, 0o600)
        self._chown(pwfile)
        subprocess.run(
            self._as_owner(
                [_bin("initdb"), "-D", str(self.data), "-U", "postgres", "-A", "scram-sha-256",
                 f"--pwfile={pwfile}", "-E", "UTF8", "--no-instructions"]
            ),
            check=True, capture_output=True, timeout=timeout,
        )  # fmt: skip
        pwfile.unlink()
        opts = f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1 " + " ".join(
            f"-c {k}={v}" for k, v in self.settings.items()
        )
        self.log.touch()
        self._chown(self.log)
        subprocess.run(
            self._as_owner([_bin("pg_ctl"), "-D", str(self.data), "-o", opts, "-l", str(self.log), "-w",
                            "-t", str(int(timeout)), "start"]),
            check=True, capture_output=True, timeout=timeout + 10,
        )  # fmt: skip
        self._started = True
        # Who owns this server: a later LocalPostgres stops it if this process died
        # without stopping it (a test run killed by a timeout).
        (self.base / OWNER_FILE).write_text(f"{os.getpid()}\n")
        self._create_database(timeout)
        return self

    def url_of(self, database: str) -> str:
        return f"postgresql+psycopg://postgres:{self.password}@127.0.0.1:{self.port}/{database}"

    def new_database(self, prefix: str = "t") -> str:
        """A fresh empty database on this server; returns its URL."""
        name = f"{prefix}_{secrets.token_hex(6)}"
        self._admin(f'CREATE DATABASE "{name}"')
        return self.url_of(name)

    def admin(self, sql: str, timeout: float = 30.0, database: str = "postgres") -> None:
        """Run one statement as the superuser (``CREATE EXTENSION``, ``CREATE DATABASE``)."""
        self._admin(sql, timeout, database)

    def _admin(self, sql: str, timeout: float = 30.0, database: str = "postgres") -> None:
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(
                    host="127.0.0.1", port=self.port, user="postgres", password=self.password,
                    dbname=database, autocommit=True, connect_timeout=5,
                ) as conn:  # fmt: skip
                    conn.execute(sql.encode())
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _create_database(self, timeout: float) -> None:
        self._admin(f'CREATE DATABASE "{self.database}"', timeout)

    def stop(self) -> None:
        if self._started:
            self._started = False
            subprocess.run(
                self._as_owner([_bin("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"]),
                capture_output=True, timeout=60,
            )  # fmt: skip
        if self._own_base:
            shutil.rmtree(self.base, ignore_errors=True)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""
