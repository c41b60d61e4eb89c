"""Container images in and out, through Debian's skopeo and umoci (no hand-rolled layers).

- ``skopeo copy`` reads every source Pal accepts (Docker archive, OCI archive, OCI layout
  directory, registry reference) into a local OCI layout, picking the linux/amd64 image
  of a multi-platform index.
- ``umoci raw unpack`` applies the layers in order with OCI whiteout semantics
  (``.wh.<name>`` deletes, ``.wh..wh..opq`` makes a directory opaque) into a root fs tree.
- ``umoci insert`` packs a directory tree as a layer (``pal image export``, tests, bench).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pal.errors import InvalidRequest

SKOPEO = "skopeo"
UMOCI = "umoci"
TAG = "pal"  # the one tag of the layouts Pal writes
ARCH = "amd64"
TRANSPORTS = ("docker://", "oci:", "oci-archive:", "docker-archive:")
TOOL_TIMEOUT_S = 3600  # a registry pull of a big image over a slow link


@dataclass(frozen=True)
class OciImage:
    """An image in a local OCI layout: its manifest digest and its config blob."""

    layout: Path
    tag: str
    manifest_digest: str
    config_digest: str  # of the config in this layout (a converted Docker config differs)
    config: dict[str, Any]
    layer_bytes: int  # compressed size of all layers, from the manifest
    source_digest: str | None = None  # the image id at the source (`docker images --no-trunc`)


def _run(argv: list[str], what: str) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=TOOL_TIMEOUT_S)
    except FileNotFoundError:
        raise InvalidRequest(f"{argv[0]} is not installed; run scripts/install.sh") from None
    if proc.returncode != 0:
        tail = " ".join((proc.stderr or proc.stdout).strip().splitlines()[-4:])
        raise InvalidRequest(f"{what}: {tail}")
    return proc.stdout


def _run_bytes(argv: list[str], what: str) -> bytes:
    proc = subprocess.run(argv, capture_output=True, check=False, timeout=TOOL_TIMEOUT_S)
    if proc.returncode != 0:
        tail = " ".join(proc.stderr.decode(errors="replace").strip().splitlines()[-4:])
        raise InvalidRequest(f"{what}: {tail}")
    return proc.stdout


def _archive_kind(path: Path) -> str:
    """skopeo transport of a local tar file, from its top-level entries."""
    try:
        with tarfile.open(path) as tar:
            names = set()
            for member in tar:  # a corrupt tar raises here, before skopeo sees it
                names.add(member.name.removeprefix("./"))
    except (tarfile.TarError, OSError, EOFError) as exc:
        why = str(exc).splitlines()[0].rstrip(":")  # tarfile lists every decompressor it tried
        if "could not be opened" in why:
            why = "not a tar file"
        raise InvalidRequest(f"{path} is not a readable image archive: {why}") from None
    if "manifest.json" in names:
        return "docker-archive"
    if "oci-layout" in names and "index.json" in names:
        return "oci-archive"
    raise InvalidRequest(f"{path} is neither a Docker archive (docker save) nor an OCI archive")


def source_ref(source: str) -> str:
    """The skopeo reference for what the user gave as SOURCE."""
    if source.startswith(TRANSPORTS):
        return source
    path = Path(source)
    if path.is_dir():
        if not (path / "oci-layout").is_file():
            raise InvalidRequest(f"{source} is a directory but not an OCI layout (no oci-layout file)")
        return f"oci:{path.resolve()}"
    if path.is_file():
        return f"{_archive_kind(path)}:{path.resolve()}"
    if source.startswith(("/", "./", "../", "~")) or source.endswith((".tar", ".tar.gz", ".tgz")):
        raise InvalidRequest(f"no such file or directory: {source}")
    return f"docker://{source}"  # a registry reference (docker.io/library/alpine:3.20, ...)


def copy_to_layout(source: str, layout: Path) -> OciImage:
    """Copy SOURCE into a new OCI layout at ``layout``; refuse what cannot run on Pal."""
    ref = source_ref(source)
    argv = [SKOPEO, "copy", "--quiet"]
    if not ref.startswith("docker://"):
        # Local files carry no signatures to check; registry pulls follow the host's policy.
        argv.append("--insecure-policy")
    # A multi-platform index resolves to its linux/amd64 image; a single-platform image of
    # another architecture is copied as it is and refused below, with a clear message.
    platform = ["--override-os", "linux", "--override-arch", ARCH]
    _run([*argv, *platform, ref, f"oci:{layout}:{TAG}"], f"cannot read image {source}")
    image = read_layout(layout, TAG)
    check_platform(image.config, source)
    # The image id as the source knows it: copying a Docker image into an OCI layout
    # re-encodes its config, so the layout's config digest is not the one users see.
    raw = _run_bytes([SKOPEO, "inspect", "--config", "--raw", *platform, ref], f"cannot inspect {source}")
    return dataclasses.replace(image, source_digest="sha256:" + hashlib.sha256(raw).hexdigest())


def _blob(layout: Path, digest: str) -> bytes:
    algo, _, hexd = digest.partition(":")
    if algo != "sha256" or not hexd or not all(c in "0123456789abcdef" for c in hexd):
        raise InvalidRequest(f"unsupported digest {digest!r} in the image")
    try:
        return (layout / "blobs" / algo / hexd).read_bytes()
    except OSError as exc:
        raise InvalidRequest(f"image blob {digest} is missing: {exc}") from None


def read_layout(layout: Path, tag: str = TAG) -> OciImage:
    try:
        index = json.loads((layout / "index.json").read_text())
        entry = next(
            m
            for m in index.get("manifests", [])
            if (m.get("annotations") or {}).get("org.opencontainers.image.ref.name") == tag
        )
        manifest = json.loads(_blob(layout, entry["digest"]))
        config_digest = manifest["config"]["digest"]
        config = json.loads(_blob(layout, config_digest))
    except (OSError, ValueError, KeyError, StopIteration, TypeError) as exc:
        raise InvalidRequest(f"not a valid OCI image layout at {layout}: {exc!r}") from None
    layers = manifest.get("layers") or []
    return OciImage(
        layout=layout,
        tag=tag,
        manifest_digest=entry["digest"],
        config_digest=config_digest,
        config=config if isinstance(config, dict) else {},
        layer_bytes=sum(int(layer.get("size", 0)) for layer in layers if isinstance(layer, dict)),
    )


def check_platform(config: dict[str, Any], source: str) -> None:
    arch, os_name = config.get("architecture"), config.get("os")
    if os_name not in (None, "", "linux"):
        raise InvalidRequest(f"image {source} is for {os_name}/{arch}; Pal runs linux/{ARCH} guests only")
    if arch not in (ARCH, "x86_64"):
        raise InvalidRequest(
            f"image {source} is for architecture {arch or 'unknown'}; Pal runs linux/{ARCH} guests only"
        )


def unpack(image: OciImage, root: Path) -> None:
    """Apply the image's layers, whiteouts included, into a new directory ``root``."""
    _run([UMOCI, "raw", "unpack", "--image", f"{image.layout}:{image.tag}", str(root)], "cannot unpack image")


def pack_tree(tree: Path, layout: Path, tag: str = TAG, config: dict[str, Any] | None = None) -> None:
    """A new OCI layout at ``layout`` whose image ``tag`` is ``tree`` as one layer.

    ``config`` sets ``env`` (list of K=V), ``workdir``, ``user``, ``cmd`` (list) and
    ``architecture`` of the image config.
    """
    config = config or {}
    if not (layout / "oci-layout").exists():
        _run([UMOCI, "init", "--layout", str(layout)], "umoci init")
    _run([UMOCI, "new", "--image", f"{layout}:{tag}"], "umoci new")
    insert(layout, tag, tree, "/")
    configure(layout, tag, config)


def insert(layout: Path, tag: str, source: Path, target: str) -> None:
    """Add ``source`` at ``target`` as a new layer."""
    _run([UMOCI, "insert", "--image", f"{layout}:{tag}", str(source), target], "umoci insert")


def whiteout(layout: Path, tag: str, target: str) -> None:
    """Add a layer deleting ``target`` (an OCI whiteout entry)."""
    _run([UMOCI, "insert", "--image", f"{layout}:{tag}", "--whiteout", target], "umoci insert --whiteout")


def configure(layout: Path, tag: str, config: dict[str, Any]) -> None:
    argv = [UMOCI, "config", "--image", f"{layout}:{tag}", "--no-history"]
    for item in config.get("env") or []:
        argv += ["--config.env", item]
    if config.get("workdir"):
        argv += ["--config.workingdir", config["workdir"]]
    if config.get("user"):
        argv += ["--config.user", config["user"]]
    for item in config.get("cmd") or []:
        argv += ["--config.cmd", item]
    if config.get("architecture"):
        argv += ["--architecture", config["architecture"]]
    if len(argv) > 5:
        _run(argv, "umoci config")


def to_archive(layout: Path, tag: str, archive: Path) -> None:
    """The layout's image ``tag`` as an OCI archive file."""
    archive.unlink(missing_ok=True)
    copy_to_archive(layout, tag, f"oci-archive:{archive}")


def copy_to_archive(layout: Path, tag: str, dest: str) -> None:
    """The layout's image ``tag`` to a skopeo destination (``docker-archive:FILE:NAME:TAG``...)."""
    _run([SKOPEO, "copy", "--quiet", "--insecure-policy", f"oci:{layout}:{tag}", dest], "skopeo copy")


def copy_layout(src: Path, src_tag: str, dest: Path, dest_tag: str) -> None:
    """Copy one image between OCI layouts (blobs are shared by digest, not rewritten)."""
    os.makedirs(dest, exist_ok=True)
    _run(
        [SKOPEO, "copy", "--quiet", "--insecure-policy", f"oci:{src}:{src_tag}", f"oci:{dest}:{dest_tag}"],
        "skopeo copy",
    )
