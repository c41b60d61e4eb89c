"""The guest bundle: everything Pal puts under ``/.pal`` in every image.

The harness must run in any image (glibc or musl, with or without Python), so it brings
its own interpreter: Debian's python3 from the default image's base system, its stdlib,
the shared libraries it and its extension modules need, and glibc's dynamic loader. It
runs as ``/.pal/lib/ld-linux-x86-64.so.2 --library-path /.pal/lib --inhibit-cache
/.pal/bin/python3 -I ...``: the loader never reads the image's ``ld.so.cache`` or libraries,
and Python finds its stdlib next to its executable (``/.pal/lib/python3.11``), so nothing
depends on the image's libc or Python. ``resize2fs`` (run by the harness at boot) comes
the same way, and a static busybox interprets ``/.pal/init``, the one PID-1 entry point of
every image (the initramfs ``switch_root``s into it).

Layout::

    /.pal/init                 PID 1 after switch_root (a busybox sh script)
    /.pal/config.json          the image's exec defaults (ImageConfig), written per image
    /.pal/harness/pal/guest/   the ``pal.guest`` package, whole (+ __pycache__)
    /.pal/bin/                 python3, resize2fs, busybox
    /.pal/lib/                 ld-linux-x86-64.so.2, the libraries, python3.11/ (stdlib)

The bundle is built once per (base system, guest files) into ``images/.cache/bundle-<key>``
and copied into each image's tree.
"""

from __future__ import annotations

import hashlib
import os
import py_compile
import shutil
import subprocess
from pathlib import Path

from pal.images import initramfs
from pal.images.modes import guest_umask

# 2: built under the guest umask (the workload user runs /.pal's python for code contexts)
BUNDLE_VERSION = 2
PAL_DIR = ".pal"  # relative to the image root: /.pal
GUEST_DIR = Path(__file__).resolve().parent.parent / "guest"  # shipped whole as /.pal/harness/pal/guest
HARNESS_DIR = "/.pal/harness"  # on sys.path in the guest: ``pal`` is an empty package there
PYTHON_VERSION = "3.11"
LOADER = "ld-linux-x86-64.so.2"
# What the harness and its boot-time tools need from the Debian base system (paths in it).
PYTHON_BINARY = f"usr/bin/python{PYTHON_VERSION}"
PYTHON_STDLIB = f"usr/lib/python{PYTHON_VERSION}"
TOOLS = {"resize2fs": "usr/sbin/resize2fs"}
# Parts of the stdlib no sandbox harness uses: left out to keep every image small.
STDLIB_EXCLUDE = frozenset(
    {
        "test",
        "idlelib",
        "tkinter",
        "turtledemo",
        "ensurepip",
        "lib2to3",
        "pydoc_data",
        "distutils",
        "venv",
        "site-packages",
        "dist-packages",
        f"config-{PYTHON_VERSION}-x86_64-linux-gnu",
    }
)
DYNLOAD_EXCLUDE_PREFIXES = ("_test", "xxlimited", "_ctypes_test", "_xxtestfuzz", "_curses", "readline")

INIT_SCRIPT = """#!/.pal/bin/busybox sh
# PID 1 after switch_root, in every image: the Pal harness under Pal's own loader, libc
# and Python (none of the image's). -I: no environment, user site or script dir in sys.path;
# -S: no site.py; -X utf8: the image may have no locales; -u: unbuffered.
exec /.pal/lib/ld-linux-x86-64.so.2 --library-path /.pal/lib --inhibit-cache \\
    /.pal/bin/python3 -I -S -X utf8 -u \\
    -c 'import sys; sys.path.insert(0, "/.pal/harness"); from pal.guest.harness import main; sys.exit(main())'
"""


def guest_files() -> list[Path]:
    """Every module of the guest package: a new file ships without a list to update."""
    return sorted(GUEST_DIR.glob("*.py"))


def guest_files_hash() -> str:
    """Hash of the files Pal writes into /.pal itself (harness, protocol, init, recipe)."""
    h = hashlib.sha256(f"bundle-v{BUNDLE_VERSION}\n".encode())
    h.update(INIT_SCRIPT.encode())
    for path in guest_files():
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def bundle_key(base_tarball_name: str) -> str:
    """Everything that decides the bundle's bytes: base system, guest files, busybox."""
    h = hashlib.sha256()
    for part in (base_tarball_name, guest_files_hash(), file_sha256(initramfs.BUSYBOX)):
        h.update(part.encode() + b"\n")
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    """The hex SHA-256 of a file's bytes (read in pieces: a kernel or busybox is large)."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-10:]
        raise RuntimeError(f"{' '.join(cmd[:3])} failed ({proc.returncode}): " + "\n".join(tail))
    return proc.stdout


def _needed_libraries(base_root: Path, binaries: list[str]) -> set[str]:
    """Absolute in-root paths of every shared library the binaries load (ldd, chrooted, so
    the base system's own loader resolves them exactly as it would at run time)."""
    out = _run(["chroot", str(base_root), "/usr/bin/ldd", *("/" + b for b in binaries)])
    libs: set[str] = set()
    for line in out.splitlines():
        line = line.strip()
        if "=>" in line:
            target = line.split("=>", 1)[1].split("(", 1)[0].strip()
            if target.startswith("/"):
                libs.add(target)
            elif target == "not found":
                raise RuntimeError(f"ldd in the base system: {line}")
        elif line.startswith("/") and "ld-linux" in line:
            libs.add(line.split("(", 1)[0].strip())
    return libs


def _copy_stdlib(src: Path, dst: Path) -> list[str]:
    """The stdlib minus what a harness never uses; returns the extension modules kept."""
    kept: list[str] = []

    def ignore(directory: str, names: list[str]) -> set[str]:
        skip = set()
        here = Path(directory)
        for n in names:
            if here == src and n in STDLIB_EXCLUDE:
                skip.add(n)
            elif here == src / "lib-dynload" and n.startswith(DYNLOAD_EXCLUDE_PREFIXES):
                skip.add(n)
        return skip

    # copy2 keeps mtimes, so the base system's compiled __pycache__ stays valid.
    shutil.copytree(src, dst, symlinks=True, ignore=ignore, copy_function=shutil.copy2)
    for so in sorted((dst / "lib-dynload").glob("*.so")):
        kept.append(f"{PYTHON_STDLIB}/lib-dynload/{so.name}")
    return kept


def build(base_root: Path, dest: Path) -> None:
    """Assemble the bundle from an unpacked Debian base system into ``dest`` (a new dir),
    under the guest's umask: the workload user reads /.pal (its code contexts run the
    bundle's python and the kernel driver; pal/guest/kernels.py), so its directories are
    0755 even when the command runs under umask 077."""
    with guest_umask():
        _build(base_root, dest)


def _build(base_root: Path, dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "bin").mkdir(parents=True)
    (dest / "lib").mkdir()
    package = dest / "harness" / "pal" / "guest"
    package.mkdir(parents=True)
    dynload = _copy_stdlib(base_root / PYTHON_STDLIB, dest / "lib" / f"python{PYTHON_VERSION}")
    shutil.copy2(base_root / PYTHON_BINARY, dest / "bin/python3")
    for name, path in TOOLS.items():
        shutil.copy2(base_root / path, dest / "bin" / name)
    for lib in sorted(_needed_libraries(base_root, [PYTHON_BINARY, *TOOLS.values(), *dynload])):
        # ldd prints the paths the loader uses (/lib64/... symlinks included): copy targets.
        shutil.copyfile(base_root / lib.lstrip("/"), dest / "lib" / Path(lib).name)
        (dest / "lib" / Path(lib).name).chmod(0o755)
    if not (dest / "lib" / LOADER).is_file():
        raise RuntimeError(f"the base system's python has no {LOADER}")
    shutil.copyfile(initramfs.BUSYBOX, dest / "bin/busybox")
    (dest / "bin/busybox").chmod(0o755)
    # ``pal`` in the guest is an empty package holding only ``guest``: nothing of the
    # host's code (nor its imports) comes along.
    (dest / "harness" / "pal" / "__init__.py").write_text("")
    for src in [dest / "harness" / "pal" / "__init__.py", *guest_files()]:
        target = package / src.name if src.parent == GUEST_DIR else src
        if target != src:
            shutil.copyfile(src, target)
        target.chmod(0o644)
        # Compiled now, so the first boot does not pay for it.
        rel = target.relative_to(dest / "harness")
        py_compile.compile(str(target), dfile=f"{HARNESS_DIR}/{rel}", doraise=True)
    (dest / "init").write_text(INIT_SCRIPT)
    (dest / "init").chmod(0o755)
    _check_runs(dest)


def _check_runs(dest: Path) -> None:
    """The bundled interpreter must start from its own files alone (no host Python, no
    host libraries): run it with the bundle's loader the way the guest will."""
    argv = [
        str(dest / "lib" / LOADER),
        "--library-path",
        str(dest / "lib"),
        "--inhibit-cache",
        str(dest / "bin/python3"),
        "-I",
        "-S",
        "-c",
        # The whole guest package imports: a module the trimmed stdlib lacks fails here.
        f"import sys; sys.path.insert(0, {str(dest / 'harness')!r}); import pal.guest.harness; "
        "print(sys.prefix)",
    ]
    out = subprocess.run(argv, capture_output=True, text=True, check=False, env={})
    if out.returncode != 0 or out.stdout.strip() != str(dest):
        raise RuntimeError(f"bundled python does not start: {out.stderr.strip()[-500:] or out.stdout}")


def ensure(cache_dir: Path, base_root_or_tarball: Path, base_tarball_name: str) -> Path:
    """The cached bundle for this base system and these guest files, built when missing.

    ``base_root_or_tarball`` is the unpacked base system (a directory) or its tarball.
    """
    final = cache_dir / f"bundle-{bundle_key(base_tarball_name)[:16]}"
    if (final / "init").is_file():
        return final
    work = cache_dir / f".bundle-build-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    try:
        if base_root_or_tarball.is_dir():
            base = base_root_or_tarball
        else:
            base = work / "base"
            base.mkdir(parents=True)
            _run(["tar", "-C", str(base), "--numeric-owner", "-xpf", str(base_root_or_tarball)])
        build(base, work / "bundle")
        shutil.rmtree(final, ignore_errors=True)
        os.rename(work / "bundle", final)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def install(bundle: Path, root: Path) -> None:
    """Put the bundle at ``root/.pal`` (replacing whatever the image had there)."""
    target = root / PAL_DIR
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.exists():
        shutil.rmtree(target)
    shutil.copytree(bundle, target, symlinks=True, copy_function=shutil.copy2)
    target.chmod(0o755)
