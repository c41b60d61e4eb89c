"""The Debian mirror(s) the host's apt already uses, as one-line `deb` entries for mmdebstrap.

We never hard-code a mirror host: CI and air-gapped installs point apt at their own mirror,
and the image must come from the same place.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

APT_DIR = Path("/etc/apt")


@dataclass(frozen=True)
class AptSource:
    uri: str
    suite: str
    components: tuple[str, ...]

    def line(self) -> str:
        return f"deb {self.uri} {self.suite} {' '.join(self.components)}"


def host_codename(os_release: Path = Path("/etc/os-release")) -> str:
    for raw in os_release.read_text().splitlines():
        key, _, value = raw.partition("=")
        if key == "VERSION_CODENAME" and value:
            return value.strip().strip('"')
    raise RuntimeError(f"no VERSION_CODENAME in {os_release}")


def _parse_one_line(text: str) -> list[AptSource]:
    out: list[AptSource] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        parts = line.split()
        if len(parts) < 3 or parts[0] != "deb":
            continue
        # Drop "[arch=amd64 signed-by=...]" options: mmdebstrap uses its own keyring.
        if parts[1].startswith("["):
            while parts and not parts[1].endswith("]"):
                del parts[1]
            del parts[1]
        if len(parts) < 3:
            continue
        out.append(AptSource(parts[1], parts[2], tuple(parts[3:]) or ("main",)))
    return out


def _parse_deb822(text: str) -> list[AptSource]:
    out: list[AptSource] = []
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        for raw in stanza.splitlines():
            if raw.startswith("#") or ":" not in raw or raw[:1].isspace():
                continue
            key, _, value = raw.partition(":")
            fields[key.strip().lower()] = value.strip()
        if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes") == "no":
            continue
        comps = tuple(fields.get("components", "main").split())
        for uri in fields.get("uris", "").split():
            for suite in fields.get("suites", "").split():
                out.append(AptSource(uri, suite, comps))
    return out


def host_sources(apt_dir: Path = APT_DIR, codename: str | None = None) -> list[AptSource]:
    """Debian entries of the host's apt config for its own release (third-party repos dropped)."""
    codename = codename or host_codename()
    found: list[AptSource] = []
    main_list = apt_dir / "sources.list"
    if main_list.is_file():
        found += _parse_one_line(main_list.read_text())
    parts_dir = apt_dir / "sources.list.d"
    if parts_dir.is_dir():
        for path in sorted(parts_dir.iterdir()):
            if path.suffix == ".list":
                found += _parse_one_line(path.read_text())
            elif path.suffix == ".sources":
                found += _parse_deb822(path.read_text())
    # Third-party repos (other suites) would need their keys inside mmdebstrap: keep only
    # the release's own suites (bookworm, bookworm-updates, bookworm-security...).
    keep = [s for s in found if s.suite == codename or s.suite.startswith(codename + "-")]
    unique = list(dict.fromkeys(keep))
    if not any(s.suite == codename for s in unique):
        raise RuntimeError(f"no apt source for {codename} in {apt_dir}; cannot build the image")
    return unique
