"""`pal image build NAME -f Dockerfile [CONTEXT]`: a Dockerfile, built by Debian's buildah.

buildah runs as root with ``--isolation chroot`` (``RUN`` steps execute in a chroot of the
image being built, so no OCI runtime such as runc or crun is needed) against a private,
throw-away storage under the data dir. The result is pushed into ``images/<name>/source``
as an OCI layout and assembled exactly like an imported image. ``FROM`` may name any
image buildah can read: a registry reference, or ``oci:DIR`` such as Pal's own default
image written by ``pal image export default --oci DIR``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from pal.config import Settings
from pal.errors import BackendError, InvalidRequest, PalError
from pal.images import assemble, importer
from pal.images.assemble import Progress
from pal.images.oci import TAG
from pal.images.paths import SOURCE, ImagePaths, validate_name

BUILDAH = "buildah"
Log = Callable[[str], None]


def _buildah(store: Path) -> list[str]:
    return [BUILDAH, "--root", str(store / "root"), "--runroot", str(store / "run")]


def _stream(argv: list[str], log: Log, what: str) -> None:
    """Run a buildah command, handing each output line to ``log``; raise with its tail."""
    tail: list[str] = []
    try:
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True
        )
    except FileNotFoundError:
        raise InvalidRequest(f"{argv[0]} is not installed; run scripts/install.sh") from None
    assert proc.stdout is not None
    with proc:
        for line in proc.stdout:
            line = line.rstrip("\n")
            log(line)
            tail = [*tail[-7:], line]
    if proc.returncode != 0:
        raise InvalidRequest(f"{what} failed: " + " | ".join(t for t in tail if t.strip()))


def _cleanup_store(store: Path) -> None:
    # buildah unmounts its containers when a build ends; a killed build may leave some.
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run([*_buildah(store), "rm", "--all"], capture_output=True, timeout=120, check=False)
        subprocess.run(
            [*_buildah(store), "rmi", "--all", "--force"], capture_output=True, timeout=120, check=False
        )
    assemble.unmount_under(store)
    shutil.rmtree(store, ignore_errors=True)


def build_dockerfile(
    settings: Settings,
    name: str,
    dockerfile: Path,
    context: Path | None = None,
    progress: Progress | None = None,
    log: Log | None = None,
    build_args: dict[str, str] | None = None,
    tenants: list[str] | None = None,
) -> ImagePaths:
    """Build ``dockerfile`` (context: ``context``, default the Dockerfile's directory);
    ``tenants``: who may use it (assemble.publish)."""
    validate_name(name)
    report = progress or assemble.quiet
    say = log or (lambda _line: None)
    dockerfile = dockerfile.resolve()
    if not dockerfile.is_file():
        raise InvalidRequest(f"no such Dockerfile: {dockerfile}")
    context = (context or dockerfile.parent).resolve()
    if not context.is_dir():
        raise InvalidRequest(f"build context {context} is not a directory")
    staging = assemble.new_staging(settings, name)
    store = settings.images_dir / f".buildah-{name}-{os.getpid()}"
    _cleanup_store(store)
    tag = f"localhost/pal-build-{name}:{os.getpid()}"
    try:
        report("buildah build", 0.05)
        argv = [*_buildah(store), "build", "--isolation", "chroot", "--layers=false", "-f", str(dockerfile)]
        for k, v in (build_args or {}).items():
            argv += ["--build-arg", f"{k}={v}"]
        _stream([*argv, "-t", tag, str(context)], say, f"buildah build of {dockerfile}")
        report("exporting the build (buildah push)", 0.3)
        _stream(
            [*_buildah(store), "push", "--quiet", tag, f"oci:{staging / SOURCE}:{TAG}"],
            say,
            "buildah push",
        )
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, PalError | KeyboardInterrupt):
            raise
        raise BackendError(f"image build failed: {exc}") from exc
    finally:
        _cleanup_store(store)
    label = f"Dockerfile {dockerfile}"
    return importer.from_layout(settings, name, staging, label, importer.KIND_DOCKERFILE, report, tenants)
