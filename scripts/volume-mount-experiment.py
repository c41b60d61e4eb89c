#!/usr/bin/env python3
"""Issue 34, phase 1: does an NFS volume survive Pal's pause, resume, fork and move?

A hand-run experiment, not a test: two (then three) microVMs under QEMU 7.2 `microvm`, each
in a network namespace of its own laid out as Pal lays them (guest 10.0.2.15, host side
10.0.2.2 on a tap), mount one NFS export of a host-side nfs-ganesha through a small proxy
that listens on 10.0.2.2 in each namespace (as Pal's gateway would) and connects to the
server in the host's namespace. It then takes a snapshot of one guest through QEMU migration
exactly as pal/vmm does (stop, x-ignore-shared, device state to a file, memory file kept),
kills it, lets the other guest write, restores it (resume), restores the same snapshot a
second time in a fresh namespace (a fork, and what a move to another node looks like to the
guest), and checks that every guest sees every other's writes. Findings: docs/volumes.md.

Needs root, nfs-ganesha + nfs-ganesha-vfs + rpcbind (started here when none listens),
busybox-static, the Pal kernel package and guest bundle in ``$DATA/images/.cache`` and a
boot set in ``$DATA/images/.boot`` (any Pal data dir that built an image). Usage:
``python3 scripts/volume-mount-experiment.py /var/lib/pal [MODE]``; MODE ``3`` (the
default) or ``4.1``: the NFS version of the run above; ``acl``: the isolation checks
instead (exports by tag, per-VM client addresses, read-only and squash enforced by the
server, exports reloaded with SIGHUP); ``move``: a resume on another node over a shared
file system (two ganeshas exporting one directory under the same Export_Id, the guest
snapshotted behind the first and restored behind the second; ``move-diff``: differing ids;
``ATTR_CACHE=1`` keeps ganesha's default attribute cache). Each run writes
``$DATA/volexp/result-<MODE>.log``.
"""

from __future__ import annotations

import asyncio
import ctypes
import gzip
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DATA = Path(sys.argv[1] if len(sys.argv) > 1 else "/var/lib/pal-fairshare")
VERS = sys.argv[2] if len(sys.argv) > 2 else "3"
WORK = DATA / "volexp"
EXPORT = WORK / "vols" / "vol1"
NFS_PORT, MNT_PORT = 12049, 12048  # ganesha on 127.0.0.1 (the guests see 2049 / 20048)
GUEST_NFS, GUEST_MNT = 2049, 20048
MODULES = (
    "virtio_ring",
    "virtio",
    "virtio_mmio",
    "virtio_console",
    "virtio_net",
    "virtio_blk",
    "nfsv3",
    "nfsv4",
)
_CLONE_NEWNET = 0x40000000
LOG: list[str] = []


def say(msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    LOG.append(line)


def run(*argv: str, check: bool = True) -> str:
    return subprocess.run(argv, check=check, capture_output=True, text=True).stdout


# ---------------------------------------------------------------- kernel and initramfs
INIT = """#!/bin/busybox sh
B=/bin/busybox
$B mount -t devtmpfs devtmpfs /dev
$B mount -t proc proc /proc
$B mount -t sysfs sysfs /sys
for m in {modules}; do $B insmod /lib/modules/$m.ko 2>/dev/null; done
$B --install -s /bin
mkdir -p /mnt /tmp /run
mount -t tmpfs tmpfs /tmp
ifconfig lo up
ifconfig eth0 10.0.2.15 netmask 255.255.255.0 up
while true; do
    [ -e /dev/hvc0 ] && sh </dev/hvc0 >/dev/hvc0 2>&1
    usleep 200000
done
"""


def build_boot() -> tuple[Path, Path]:
    boot = sorted((DATA / "images/.boot").iterdir())[0]
    vmlinux = boot / "vmlinux"
    initrd = WORK / "initrd.gz"
    if initrd.exists():
        return vmlinux, initrd
    deb = sorted((DATA / "images/.cache").glob("linux-image-*.deb"))[0]
    kdir = WORK / "kernel"
    shutil.rmtree(kdir, ignore_errors=True)
    run("dpkg-deb", "-x", str(deb), str(kdir))
    moddir = next((kdir / "lib/modules").iterdir())
    import importlib.util

    # pal/images/initramfs.py alone (stdlib only): its module order and decompression.
    src = Path(__file__).resolve().parents[1] / "pal/images/initramfs.py"
    spec = importlib.util.spec_from_file_location("pal_initramfs", src)
    assert spec is not None and spec.loader is not None
    initramfs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(initramfs)

    initramfs.WANTED_MODULES = MODULES  # type: ignore[misc]
    order = initramfs.module_load_order(moddir, MODULES)
    root = WORK / "initramfs"
    shutil.rmtree(root, ignore_errors=True)
    for d in ("bin", "dev", "proc", "sys", "lib/modules"):
        (root / d).mkdir(parents=True)
    shutil.copyfile("/bin/busybox", root / "bin/busybox")
    (root / "bin/busybox").chmod(0o755)
    (root / "bin/sh").symlink_to("busybox")
    for name, path in order:
        initramfs._copy_module(path, root / "lib/modules" / f"{name}.ko")
    (root / "init").write_text(INIT.format(modules=" ".join(n for n, _ in order)))
    (root / "init").chmod(0o755)
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    cpio = subprocess.run(
        ["cpio", "-o", "-H", "newc", "--quiet", "--owner=0:0"],
        input=("\n".join(files) + "\n").encode(),
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    initrd.write_bytes(gzip.compress(cpio, compresslevel=6))
    say(f"initramfs: {len(order)} modules ({', '.join(n for n, _ in order)}), {initrd.stat().st_size} bytes")
    return vmlinux, initrd


# ---------------------------------------------------------------- nfs-ganesha
GANESHA_CONF = """
NFS_CORE_PARAM {{
    Protocols = 3, 4;
    NFS_Port = {nfs};
    MNT_Port = {mnt};
    Bind_addr = 127.0.0.1;
    Enable_NLM = false;
    Enable_RQUOTA = false;
    Enable_UDP = false;
}}
NFSV4 {{
    Graceless = true;
    RecoveryBackend = fs;
}}
NFS_KRB5 {{ Active_krb5 = false; }}
EXPORT {{
    Export_Id = 1;
    Path = {path};
    Pseudo = /vol1;
    Access_Type = RW;
    Squash = No_Root_Squash;
    Protocols = 3, 4;
    Transports = TCP;
    SecType = sys;
    FSAL {{ Name = VFS; }}
}}
"""


def start_rpcbind() -> subprocess.Popen[bytes] | None:
    """ganesha registers its NFSv3 and MOUNT programs with rpcbind and stops when it cannot
    (``Cannot register NFS V3 on TCP``), even though the guests never ask rpcbind."""
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 111)) == 0:
            return None
    proc = subprocess.Popen(["rpcbind", "-f"])
    for _ in range(100):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", 111)) == 0:
                return proc
        time.sleep(0.05)
    raise RuntimeError("rpcbind did not listen")


def start_ganesha(keep: bool = False) -> subprocess.Popen[bytes]:
    EXPORT.mkdir(parents=True, exist_ok=True)
    for f in [] if keep else EXPORT.iterdir():
        f.unlink()
    conf = WORK / "ganesha.conf"
    conf.write_text(GANESHA_CONF.format(nfs=NFS_PORT, mnt=MNT_PORT, path=EXPORT))
    recovery = Path("/var/lib/nfs/ganesha")
    recovery.mkdir(parents=True, exist_ok=True)
    log = WORK / "ganesha.log"
    if not keep:
        log.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [
            "ganesha.nfsd",
            "-F",
            "-L",
            str(log),
            "-f",
            str(conf),
            "-p",
            str(WORK / "ganesha.pid"),
            "-N",
            "NIV_EVENT",
        ]
    )
    for _ in range(200):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", NFS_PORT)) == 0:
                say(f"ganesha up (pid {proc.pid})")
                return proc
        time.sleep(0.1)
    raise RuntimeError(f"ganesha did not listen; log:\n{log.read_text() if log.exists() else ''}")


# ---------------------------------------------------------------- namespaces and the proxy
def netns(name: str) -> None:
    run("ip", "netns", "del", name, check=False)
    run("ip", "netns", "add", name)
    run("ip", "-n", name, "tuntap", "add", "dev", "tap0", "mode", "tap")
    run("ip", "-n", name, "addr", "add", "10.0.2.2/24", "dev", "tap0")
    run("ip", "-n", name, "link", "set", "tap0", "address", "02:50:41:4c:00:02")
    run("ip", "-n", name, "link", "set", "tap0", "up")
    run("ip", "-n", name, "link", "set", "lo", "up")


def listen_in(name: str, port: int) -> socket.socket:
    """A listener on 10.0.2.2:port made inside the namespace (a thread setns's into it)."""
    out: list[socket.socket] = []

    def inside() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns")
        os.close(fd)
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("10.0.2.2", port))
        s.listen(16)
        s.setblocking(False)
        out.append(s)

    import threading

    t = threading.Thread(target=inside)
    t.start()
    t.join()
    return out[0]


class Proxy:
    """The node's side of a VM's NFS traffic: accept in the VM's namespace, connect to the
    server in the host's. ``cut()`` drops every connection (what a netns torn down at a
    pause does to them)."""

    def __init__(
        self, name: str, source: str = "127.0.0.1", ports: tuple[int, int] = (NFS_PORT, MNT_PORT)
    ) -> None:
        self.name = name
        self.ports = ports  # the server's (nfs, mount) ports: which node's ganesha
        self.source = source  # the loopback address the server sees this VM as
        self.conns: list[asyncio.StreamWriter] = []
        self.servers: list[asyncio.AbstractServer] = []
        self.accepted = 0

    async def start(self) -> None:
        for guest_port, host_port in ((GUEST_NFS, self.ports[0]), (GUEST_MNT, self.ports[1])):
            sock = listen_in(self.name, guest_port)
            srv = await asyncio.start_server(lambda r, w, p=host_port: self._serve(r, w, p), sock=sock)
            self.servers.append(srv)

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, port: int) -> None:
        self.accepted += 1
        ur, uw = await asyncio.open_connection("127.0.0.1", port, local_addr=(self.source, 0))
        self.conns += [w, uw]

        async def pipe(a: asyncio.StreamReader, b: asyncio.StreamWriter) -> None:
            try:
                while data := await a.read(1 << 16):
                    b.write(data)
                    await b.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                b.close()

        await asyncio.gather(pipe(r, uw), pipe(ur, w), return_exceptions=True)

    def cut(self) -> None:
        for w in self.conns:
            w.transport.abort()
        self.conns.clear()

    async def close(self) -> None:
        self.cut()
        for s in self.servers:
            s.close()


# ---------------------------------------------------------------- a guest
def bundle_image() -> Path:
    """Pal's guest bundle (its Python, libc and harness: what the guest has at /.pal) as a
    read-only ext4 disk, so the guest can run the harness's own reset_tcp_connections."""
    img = WORK / "bundle.ext4"
    if not img.exists():
        src = sorted((DATA / "images/.cache").glob("bundle-*"))[0]
        with img.open("wb") as f:
            f.truncate(128 << 20)
        run("mkfs.ext4", "-q", "-d", str(src), str(img))
    return img


# What the harness runs after every restore (pal/guest/netsetup.py), here by hand.
RESET = (
    "/.pal/lib/ld-linux-x86-64.so.2 --library-path /.pal/lib --inhibit-cache /.pal/bin/python3 -I -S -c "
    '\'import sys; sys.path.insert(0, "/.pal/harness"); from pal.guest import netsetup; '
    'print("reset", netsetup.reset_tcp_connections())\''
)


def tsc_khz() -> int:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("cpu MHz"):
            return int(float(line.split(":")[1]) * 1000)
    return 2_000_000


class Guest:
    def __init__(self, name: str, ns: str, vmlinux: Path, initrd: Path) -> None:
        self.name, self.ns, self.vmlinux, self.initrd = name, ns, vmlinux, initrd
        self.dir = WORK / name
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)
        self.proc: subprocess.Popen[bytes] | None = None
        self.con: socket.socket | None = None
        self.qmp: socket.socket | None = None
        self.n = 0

    def argv(self, mem: Path, incoming: bool) -> list[str]:
        k = tsc_khz()
        append = (
            "quiet loglevel=0 panic=-1 nokaslr mitigations=off tsc=reliable no_timer_check "
            f"tsc_early_khz={k} lpj={4 * k} random.trust_cpu=on cryptomgr.notests i8042.noaux "
            "i8042.nokbd i8042.nopnp 8250.nr_uarts=0 console=hvc0"
        )
        disk = self.dir / "disk.raw"
        if not disk.exists():
            with disk.open("wb") as f:
                f.truncate(256 << 20)
        a = [
            "ip", "netns", "exec", self.ns,
            "qemu-system-x86_64", "-nodefaults", "-no-user-config", "-nographic",
            "-serial", "none", "-monitor", "none", "-parallel", "none",
            "-object", f"memory-backend-file,id=mem,size=256M,mem-path={mem},share=on",
            "-M", "microvm,x-option-roms=off,isa-serial=off,pit=on,rtc=on,memory-backend=mem",
            "-m", "256M", "-smp", "1", "-accel", "tcg,tb-size=64", "-cpu", "max",
            "-kernel", str(self.vmlinux), "-initrd", str(self.initrd), "-append", append,
            "-device", "virtio-serial-device,max_ports=2",
            "-chardev", f"socket,id=con,path={self.dir}/con.sock,server=on,wait=off",
            "-device", "virtconsole,chardev=con",
            "-netdev", "tap,id=n0,ifname=tap0,script=no,downscript=no,vhost=off",
            "-device", "virtio-net-device,netdev=n0,mac=02:50:41:4c:00:0f",
            "-drive", f"id=d0,if=none,file={disk},format=raw,cache=unsafe,aio=threads",
            "-device", "virtio-blk-device,drive=d0",
            "-drive", f"id=d1,if=none,file={bundle_image()},format=raw,readonly=on",
            "-device", "virtio-blk-device,drive=d1",
            "-qmp", f"unix:{self.dir}/qmp.sock,server=on,wait=off",
        ]  # fmt: skip
        return a + (["-incoming", "defer"] if incoming else [])

    def _start(self, mem: Path, incoming: bool) -> None:
        for s in ("con.sock", "qmp.sock"):
            (self.dir / s).unlink(missing_ok=True)
        log = (self.dir / "qemu.log").open("ab")
        self.proc = subprocess.Popen(self.argv(mem, incoming), stdout=log, stderr=log)
        for _ in range(300):
            if (self.dir / "qmp.sock").exists() and (self.dir / "con.sock").exists():
                break
            time.sleep(0.02)
        self.qmp = socket.socket(socket.AF_UNIX)
        self.qmp.connect(str(self.dir / "qmp.sock"))
        self._qmp_read()
        self.cmd_qmp("qmp_capabilities")
        self.con = socket.socket(socket.AF_UNIX)
        self.con.connect(str(self.dir / "con.sock"))

    def boot(self) -> float:
        t0 = time.monotonic()
        mem = self.dir / "mem"
        with mem.open("wb") as f:
            f.truncate(256 << 20)
        self._start(mem, incoming=False)
        self.sh("stty -echo", timeout=120, tolerant=True)
        self.sh("mkdir -p /.pal && mount -t ext4 -o ro /dev/vdb /.pal")
        return time.monotonic() - t0

    def _qmp_read(self) -> dict[str, object]:
        assert self.qmp is not None
        buf = b""
        while True:
            buf += self.qmp.recv(65536)
            for line in buf.split(b"\n"):
                if not line.strip():
                    continue
                msg = json.loads(line)
                if "event" not in msg:
                    return msg  # type: ignore[no-any-return]
            buf = b"" if buf.endswith(b"\n") else buf.rsplit(b"\n", 1)[-1]

    def cmd_qmp(self, execute: str, **args: object) -> dict[str, object]:
        assert self.qmp is not None
        self.qmp.sendall(json.dumps({"execute": execute, "arguments": args}).encode() + b"\n")
        reply = self._qmp_read()
        if "error" in reply:
            raise RuntimeError(f"{self.name}: QMP {execute}: {reply['error']}")
        return reply

    def sh(self, cmd: str, timeout: float = 60, tolerant: bool = False) -> tuple[int, str]:
        """Run a shell command in the guest; (status, output)."""
        n = self.send(cmd)
        status, out = self.wait(n, timeout)
        if status != 0 and not tolerant:
            say(f"{self.name}: `{cmd}` exited {status}: {out[-300:]}")
        return status, out

    def send(self, cmd: str) -> int:
        """Send a command without waiting for it; its number, for :meth:`wait`."""
        assert self.con is not None
        self.n += 1
        self.con.sendall(f'{cmd}; echo __END{self.n}"__" $?\n'.encode())
        return self.n

    def wait(self, n: int, timeout: float) -> tuple[int, str]:
        """The status and output of command ``n``, read from the console connected now."""
        assert self.con is not None
        marker = f"__END{n}__"
        self.con.settimeout(timeout)
        buf = b""
        deadline = time.monotonic() + timeout
        while marker.encode() not in buf:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: command {n} gave no answer in {timeout}s: {buf[-400:]!r}")
            try:
                chunk = self.con.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                raise ConnectionError(f"{self.name}: the console closed (its QEMU stopped)")
            buf += chunk
        text = buf.decode(errors="replace")
        head, _, tail = text.partition(marker)
        status = int(tail.split()[0]) if tail.split() else -1
        return status, head.replace("\r", "").strip()

    def snapshot(self, dest: Path) -> float:
        """pal/vmm's capture: stop, device state with x-ignore-shared, the RAM file kept."""
        t0 = time.monotonic()
        dest.mkdir(parents=True, exist_ok=True)
        self.cmd_qmp("stop")
        self.cmd_qmp(
            "migrate-set-capabilities", capabilities=[{"capability": "x-ignore-shared", "state": True}]
        )
        self.cmd_qmp("migrate", uri=f"exec:cat > {dest}/vmstate")
        while True:
            st = self.cmd_qmp("query-migrate")["return"]
            status = st.get("status")  # type: ignore[union-attr]
            if status == "completed":
                break
            if status in ("failed", "cancelled"):
                raise RuntimeError(f"{self.name}: migration {status}: {st}")
            time.sleep(0.01)
        run("cp", "--reflink=auto", str(self.dir / "mem"), str(dest / "mem"))
        run("cp", "--reflink=auto", str(self.dir / "disk.raw"), str(dest / "disk.raw"))
        return time.monotonic() - t0

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def restore(self, snap: Path) -> float:
        t0 = time.monotonic()
        mem = self.dir / "mem"
        run("cp", "--reflink=auto", str(snap / "mem"), str(mem))
        run("cp", "--reflink=auto", str(snap / "disk.raw"), str(self.dir / "disk.raw"))
        self._start(mem, incoming=True)
        self.cmd_qmp(
            "migrate-set-capabilities", capabilities=[{"capability": "x-ignore-shared", "state": True}]
        )
        self.cmd_qmp("migrate-incoming", uri=f"exec:cat {snap}/vmstate")
        while True:
            st = self.cmd_qmp("query-migrate")["return"]
            if st.get("status") == "completed":  # type: ignore[union-attr]
                break
            time.sleep(0.01)
        self.cmd_qmp("cont")
        return time.monotonic() - t0


# ---------------------------------------------------------------- the experiment
def mount_opts() -> str:
    if VERS == "3" or VERS.startswith("move"):
        return (
            f"vers=3,proto=tcp,port={GUEST_NFS},mountport={GUEST_MNT},mountproto=tcp,nolock,"
            "hard,timeo=50,retrans=3"
        )
    return f"vers={VERS},proto=tcp,port={GUEST_NFS},hard,timeo=50,retrans=3"


def export_path() -> str:
    return str(EXPORT) if VERS == "3" else "/vol1"


def first_answer(guest: Guest) -> None:
    """The restored guest's first commands without the volume: what a restore costs any
    command under TCG (its code translated again), to tell apart from the NFS reconnect."""
    for n in (1, 2):
        t0 = time.monotonic()
        guest.sh("true")
        say(f"{guest.name}: command {n} after the restore (no NFS): {time.monotonic() - t0:.2f}s")


def expect(guest: Guest, cmd: str, want: str) -> None:
    t0 = time.monotonic()
    status, out = guest.sh(cmd, timeout=180)
    ok = status == 0 and want in out
    say(f"{guest.name}: {cmd!r} -> {out[-120:]!r} ({time.monotonic() - t0:.2f}s) {'OK' if ok else 'FAILED'}")
    if not ok:
        raise SystemExit(f"expected {want!r}")


async def main() -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    vmlinux, initrd = build_boot()
    rpcbind = start_rpcbind()
    ganesha = start_ganesha()
    proxies: dict[str, Proxy] = {}
    guests: list[Guest] = []
    try:
        for n in ("volexp-a", "volexp-b", "volexp-c"):
            netns(n)
            proxies[n] = Proxy(n)
            await proxies[n].start()
        a = Guest("a", "volexp-a", vmlinux, initrd)
        b = Guest("b", "volexp-b", vmlinux, initrd)
        guests += [a, b]
        for g in (a, b):
            say(f"{g.name}: booted in {await asyncio.to_thread(g.boot):.2f}s")
        for g in (a, b):
            t0 = time.monotonic()
            st, out = await asyncio.to_thread(
                g.sh, f"mount -t nfs -o {mount_opts()} 10.0.2.2:{export_path()} /mnt", 120
            )
            say(f"{g.name}: mount -> {st} {out[-200:]!r} in {time.monotonic() - t0:.2f}s")
            if st != 0:
                raise SystemExit("mount failed")
        await asyncio.to_thread(expect, a, "echo from-a > /mnt/a.txt && cat /mnt/a.txt", "from-a")
        await asyncio.to_thread(expect, b, "cat /mnt/a.txt", "from-a")
        await asyncio.to_thread(expect, b, "echo from-b >> /mnt/a.txt && cat /mnt/a.txt", "from-b")
        await asyncio.to_thread(expect, a, "cat /mnt/a.txt", "from-b")
        for g, target in ((a, "/mnt/big"), (a, "/dev/vda")):
            t0 = time.monotonic()
            st, out = await asyncio.to_thread(
                g.sh, f"dd if=/dev/zero of={target} bs=1M count=64 conv=fsync 2>&1 | tail -1", 300
            )
            say(f"{g.name}: write 64 MiB to {target}: {time.monotonic() - t0:.2f}s {out!r}")
        t0 = time.monotonic()
        st, out = await asyncio.to_thread(b.sh, "dd if=/mnt/big of=/dev/null bs=1M 2>&1 | tail -1", 300)
        say(f"b: read 64 MiB over NFS: {time.monotonic() - t0:.2f}s {out!r}")
        await asyncio.to_thread(a.sh, "echo kept-open > /mnt/open.txt; exec 7</mnt/open.txt")

        # Pause A: a snapshot through migration (nothing blocks it: no device of the volume).
        snap = WORK / "snap-a"
        shutil.rmtree(snap, ignore_errors=True)
        say(f"a: snapshot (migration) in {await asyncio.to_thread(a.snapshot, snap):.2f}s")
        a.kill()
        proxies["volexp-a"].cut()  # Pal tears the namespace's connections down with the QEMU
        await asyncio.to_thread(
            expect,
            b,
            "echo while-a-paused > /mnt/paused.txt && echo b-rewrote > /mnt/a.txt; cat /mnt/paused.txt",
            "while-a-paused",
        )

        # Resume A (same namespace, new QEMU).
        say(f"a: restored in {await asyncio.to_thread(a.restore, snap):.2f}s")
        await asyncio.to_thread(first_answer, a)
        # What the harness does after a restore: abort every TCP connection. Is the NFS
        # client's kernel socket among them (/proc/net/tcp: 0202000A:0801 is 10.0.2.2:2049)?
        nfs = "cut -c1-40 /proc/net/tcp | tail -n +2 | tr '\\n' '|'; echo"
        _, before = await asyncio.to_thread(a.sh, nfs, 60, True)
        _, out = await asyncio.to_thread(a.sh, RESET, 120, True)
        _, after = await asyncio.to_thread(a.sh, nfs, 60, True)
        say(f"a: NFS socket states (hex) before the reset {before!r}; {out[-20:]!r}; after {after!r}")
        t0 = time.monotonic()
        await asyncio.to_thread(expect, a, "cat /mnt/paused.txt", "while-a-paused")
        say(f"a: first NFS answer after the restore: {time.monotonic() - t0:.2f}s")
        await asyncio.to_thread(expect, a, "cat /mnt/a.txt", "b-rewrote")
        await asyncio.to_thread(expect, a, "cat <&7", "kept-open")
        await asyncio.to_thread(
            expect, a, "echo a-after-resume > /mnt/resumed.txt; cat /mnt/resumed.txt", "a-after"
        )
        await asyncio.to_thread(expect, b, "cat /mnt/resumed.txt", "a-after-resume")

        # Fork (or move): the same snapshot restored again, in a fresh namespace.
        c = Guest("c", "volexp-c", vmlinux, initrd)
        guests.append(c)
        say(f"c: restored (fork of a's snapshot) in {await asyncio.to_thread(c.restore, snap):.2f}s")
        await asyncio.to_thread(first_answer, c)
        t0 = time.monotonic()
        await asyncio.to_thread(expect, c, "cat /mnt/resumed.txt", "a-after-resume")
        say(f"c: first NFS answer after the restore: {time.monotonic() - t0:.2f}s")
        await asyncio.to_thread(expect, c, "echo from-c > /mnt/c.txt; cat /mnt/c.txt", "from-c")
        await asyncio.to_thread(expect, a, "echo from-a2 > /mnt/a2.txt; cat /mnt/c.txt", "from-c")
        await asyncio.to_thread(expect, c, "cat /mnt/a2.txt", "from-a2")
        await asyncio.to_thread(expect, b, "cat /mnt/c.txt /mnt/a2.txt", "from-a2")

        # A second pause of the resumed guest, and its resume.
        snap2 = WORK / "snap-a2"
        shutil.rmtree(snap2, ignore_errors=True)
        say(f"a: second snapshot in {await asyncio.to_thread(a.snapshot, snap2):.2f}s")
        a.kill()
        proxies["volexp-a"].cut()
        say(f"a: restored again in {await asyncio.to_thread(a.restore, snap2):.2f}s")
        await asyncio.to_thread(expect, a, "cat /mnt/c.txt", "from-c")
        rss = run("ps", "-o", "rss=", "-p", str(ganesha.pid)).strip()

        # A request in flight when the pause comes: the server stopped (SIGSTOP) so that A's
        # read waits on it, A snapshotted and killed, the server continued, A restored. Its
        # read was sent on a connection that is gone: how long until it is answered?
        ganesha.send_signal(signal.SIGSTOP)
        pending = a.send("echo 3 > /proc/sys/vm/drop_caches; cat /mnt/c.txt")
        await asyncio.sleep(1)
        snap3 = WORK / "snap-a3"
        shutil.rmtree(snap3, ignore_errors=True)
        say(f"a: snapshot with an NFS read in flight in {await asyncio.to_thread(a.snapshot, snap3):.2f}s")
        a.kill()
        proxies["volexp-a"].cut()
        ganesha.send_signal(signal.SIGCONT)
        say(f"a: restored in {await asyncio.to_thread(a.restore, snap3):.2f}s")
        t0 = time.monotonic()
        st_p, out_p = await asyncio.to_thread(a.wait, pending, 180)
        say(
            f"a: the read in flight at the pause answered {time.monotonic() - t0:.2f}s after the restore:"
            f" {st_p} {out_p[-40:]!r}"
        )

        # The server killed (SIGKILL) after an fsync'd write, and started again: the node
        # restarts. NFSv3 keeps no client state, and the file handles are the file system's.
        await asyncio.to_thread(
            expect, c, "echo synced > /mnt/synced.txt && sync /mnt/synced.txt; echo ok", "ok"
        )
        ganesha.kill()
        ganesha.wait()
        for pr in proxies.values():
            pr.cut()
        # A guest that asks meanwhile waits (a hard mount) and goes on once the server is back.
        waiting = asyncio.create_task(asyncio.to_thread(expect, b, "ls -l /mnt/synced.txt", "synced"))
        await asyncio.sleep(3)
        say(f"b: still waiting on the dead server after 3 s: {not waiting.done()}")
        ganesha = start_ganesha(keep=True)
        await waiting
        for g in (a, b, c):
            await asyncio.to_thread(expect, g, "cat /mnt/synced.txt && ls /mnt | wc -l", "synced")
        await asyncio.to_thread(expect, a, "echo after-restart > /mnt/r.txt; cat /mnt/r.txt", "after-restart")
        await asyncio.to_thread(expect, c, "cat /mnt/r.txt", "after-restart")
        say(
            f"ganesha RSS {rss} KiB; proxy connections accepted: "
            + ", ".join(f"{k}={p.accepted}" for k, p in proxies.items())
        )
        say("ALL CHECKS PASSED")
    finally:
        for g in guests:
            g.kill()
        for p in proxies.values():
            await p.close()
        ganesha.terminate()
        ganesha.wait()
        if rpcbind is not None:
            rpcbind.terminate()
            rpcbind.wait()
        for n in proxies:
            run("ip", "netns", "del", n, check=False)
        (WORK / f"result-{VERS}.log").write_text("\n".join(LOG) + "\n")


# ---------------------------------------------------------------- isolation (``acl`` mode)
ACL_EXPORT = """
EXPORT {{
    Export_Id = {id};
    Path = {path};
    Pseudo = /{name};
    Tag = {name};
    Access_Type = None;
    Squash = All_Squash;
    Anonymous_Uid = 1000;
    Anonymous_Gid = 1000;
    Protocols = 3;
    Transports = TCP;
    SecType = sys;
    FSAL {{ Name = VFS; }}
    {clients}
}}
"""


def acl_conf(exports: list[tuple[int, str, str]]) -> str:
    """The server's config with these exports: (id, name, CLIENT blocks)."""
    head = GANESHA_CONF.split("EXPORT {{")[0].format(nfs=NFS_PORT, mnt=MNT_PORT)
    body = "".join(
        ACL_EXPORT.format(id=i, path=WORK / "vols" / name, name=name, clients=clients)
        for i, name, clients in exports
    )
    return head + body


def rw(*addrs: str) -> str:
    return f"CLIENT {{ Clients = {', '.join(addrs)}; Access_Type = RW; }}"


def ro(*addrs: str) -> str:
    return f"CLIENT {{ Clients = {', '.join(addrs)}; Access_Type = RO; }}"


def v3_mount(export: str) -> str:
    opts = f"vers=3,proto=tcp,port={GUEST_NFS},mountport={GUEST_MNT},mountproto=tcp,nolock"
    return f"mount -t nfs -o {opts} 10.0.2.2:{export} /mnt/{export}"  # by its Tag: no host path


async def acl() -> None:
    """Each VM is its own loopback address to the server; an export names the VMs that mount
    it (RW or RO). Checks: a VM mounts only its volumes; RO is the server's; a squashed
    write is uid 1000's on the host; an export added to the running server (SIGHUP)."""
    vmlinux, initrd = build_boot()
    for name in ("vol1", "vol2"):
        d = WORK / "vols" / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        os.chown(d, 1000, 1000)  # the squashed uid owns the volume's files (and its root)
    (WORK / "vols" / "vol2" / "seed.txt").write_text("seeded\n")
    conf = WORK / "ganesha-acl.conf"
    conf.write_text(acl_conf([(1, "vol1", rw("127.0.0.2", "127.0.0.3"))]))
    rpcbind = start_rpcbind()
    log = WORK / "ganesha-acl.log"
    log.unlink(missing_ok=True)
    ganesha = subprocess.Popen(  # noqa: ASYNC220
        ["ganesha.nfsd", "-F", "-L", str(log), "-f", str(conf), "-p", str(WORK / "g.pid")]
    )
    proxies: dict[str, Proxy] = {}
    guests: list[Guest] = []
    try:
        for _ in range(200):
            with socket.socket() as sk:
                if sk.connect_ex(("127.0.0.1", NFS_PORT)) == 0:
                    break
            await asyncio.sleep(0.1)
        for n, src in (("volexp-a", "127.0.0.2"), ("volexp-b", "127.0.0.3")):
            netns(n)
            proxies[n] = Proxy(n, src)
            await proxies[n].start()
        a = Guest("a", "volexp-a", vmlinux, initrd)
        b = Guest("b", "volexp-b", vmlinux, initrd)
        guests += [a, b]
        for g in (a, b):
            say(f"{g.name}: booted in {await asyncio.to_thread(g.boot):.2f}s")
            await asyncio.to_thread(g.sh, "mkdir -p /mnt/vol1 /mnt/vol2")
        for g in (a, b):
            await asyncio.to_thread(expect, g, v3_mount("vol1") + " && echo mounted", "mounted")
        await asyncio.to_thread(expect, a, "echo as-root > /mnt/vol1/f && ls -ln /mnt/vol1/f", " 1000 ")
        st = (WORK / "vols/vol1/f").stat()
        say(f"host: vol1/f is uid {st.st_uid} gid {st.st_gid} (squashed to the workload user)")
        # vol2 is not exported to anyone yet; then added for B alone, read-only.
        st_b, out_b = await asyncio.to_thread(b.sh, v3_mount("vol2"), 60, True)
        say(f"b: mount vol2 before it is exported to b -> {st_b} {out_b[-120:]!r}")
        conf.write_text(acl_conf([(1, "vol1", rw("127.0.0.2", "127.0.0.3")), (2, "vol2", ro("127.0.0.3"))]))
        ganesha.send_signal(signal.SIGHUP)
        t0 = time.monotonic()
        while True:
            st_b, out_b = await asyncio.to_thread(b.sh, v3_mount("vol2"), 60, True)
            if st_b == 0 or time.monotonic() - t0 > 20:
                break
            await asyncio.sleep(0.5)
        say(f"b: mount vol2 after SIGHUP added it for b (RO) -> {st_b} after {time.monotonic() - t0:.1f}s")
        await asyncio.to_thread(expect, b, "cat /mnt/vol2/seed.txt", "seeded")
        st_w, out_w = await asyncio.to_thread(b.sh, "echo x > /mnt/vol2/new.txt", 60, True)
        say(f"b: write into the RO export (mounted rw by the guest) -> {st_w} {out_w[-100:]!r}")
        st_a, out_a = await asyncio.to_thread(a.sh, v3_mount("vol2"), 60, True)
        say(f"a: mount vol2, exported to b only -> {st_a} {out_a[-120:]!r}")
        # B stops mounting vol2 (its VM stops, say): the export drops it. The server checks
        # every request against the export's clients, so the mount B still has (and any file
        # handle it kept or forged) reads nothing more.
        conf.write_text(acl_conf([(1, "vol1", rw("127.0.0.2", "127.0.0.3")), (2, "vol2", ro("127.0.0.4"))]))
        ganesha.send_signal(signal.SIGHUP)
        await asyncio.sleep(1)
        st_r, out_r = await asyncio.to_thread(
            b.sh, "echo 3 > /proc/sys/vm/drop_caches; cat /mnt/vol2/seed.txt", 60, True
        )
        say(f"b: read vol2 after the export dropped b -> {st_r} {out_r[-100:]!r}")
        await asyncio.to_thread(expect, b, "cat /mnt/vol1/f", "as-root")
        # Exports change whenever a VM of the node starts or stops: reloads while another VM
        # writes must not disturb it.
        writing = asyncio.create_task(
            asyncio.to_thread(
                b.sh,
                "dd if=/dev/urandom of=/mnt/vol1/big bs=1M count=32 conv=fsync 2>&1 | tail -1;"
                " md5sum /mnt/vol1/big",
                300,
            )
        )
        reloads = 0
        while not writing.done():
            extra = [(2, "vol2", ro("127.0.0.4"))] if reloads % 2 else []
            conf.write_text(acl_conf([(1, "vol1", rw("127.0.0.2", "127.0.0.3")), *extra]))
            ganesha.send_signal(signal.SIGHUP)
            reloads += 1
            await asyncio.sleep(0.2)
        st_d, out_d = await writing
        host_md5 = run("md5sum", str(WORK / "vols/vol1/big")).split()[0]
        same = host_md5 in out_d
        say(f"b: 32 MiB written during {reloads} reloads -> {st_d}, md5 the same on the host: {same}")
        ok = st_b == 0 and st_w != 0 and st_a != 0 and st.st_uid == 1000 and st_r != 0 and st_d == 0 and same
        say("ACL CHECKS PASSED" if ok else "ACL CHECKS FAILED")
    finally:
        for g in guests:
            g.kill()
        for pr in proxies.values():
            await pr.close()
        ganesha.terminate()
        ganesha.wait()
        if rpcbind is not None:
            rpcbind.terminate()
            rpcbind.wait()
        for n in proxies:
            run("ip", "netns", "del", n, check=False)
        (WORK / "result-acl.log").write_text("\n".join(LOG) + "\n")


MOVE_CONF = """NFS_CORE_PARAM {{
    Protocols = 3;
    NFS_Port = {nfs};
    MNT_Port = {mnt};
    Bind_addr = 127.0.0.1;
    Enable_NLM = false;
    Enable_RQUOTA = false;
    Enable_UDP = false;
}}
NFSV4 {{ Graceless = true; }}
NFS_KRB5 {{ Active_krb5 = false; }}
EXPORT {{
    Export_Id = {id};
    Path = {path};
    Pseudo = /vol1;
    Tag = vol1;
    Access_Type = RW;
    Squash = No_Root_Squash;
    Protocols = 3;{attr}
    Transports = TCP;
    SecType = sys;
    FSAL {{ Name = VFS; }}
}}
"""


def start_node_ganesha(name: str, nfs: int, mnt: int, export_id: int) -> subprocess.Popen[bytes]:
    """A second node's ganesha as this machine can have one: its own ports, config, log and
    pid file, exporting the same directory (the shared file system) under ``export_id``."""
    d = WORK / name
    d.mkdir(parents=True, exist_ok=True)
    conf = d / "ganesha.conf"
    attr = "" if os.environ.get("ATTR_CACHE") else "\n    Attr_Expiration_Time = 0;"
    conf.write_text(MOVE_CONF.format(nfs=nfs, mnt=mnt, id=export_id, path=EXPORT, attr=attr))
    log = d / "ganesha.log"
    log.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [
            "ganesha.nfsd",
            "-F",
            "-L",
            str(log),
            "-f",
            str(conf),
            "-p",
            str(d / "ganesha.pid"),
            "-N",
            "NIV_EVENT",
        ]
    )
    for _ in range(200):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", nfs)) == 0:
                say(f"{name}: ganesha up on {nfs}/{mnt}, Export_Id {export_id} (pid {proc.pid})")
                return proc
        time.sleep(0.1)
    raise RuntimeError(f"{name}: ganesha did not listen: {log.read_text() if log.exists() else ''}")


async def move() -> None:
    """A resume on another node against a shared file system: node A's and node B's ganesha
    export the same directory; guest A mounts through A's, writes, keeps a file open, is
    snapshotted and killed, and its snapshot is restored in a fresh namespace whose relay goes
    to B's ganesha (what a resume on B is to the guest). Run with B's Export_Id the same as
    A's (MODE ``move``) and different (``move-diff``): are the handles the same?"""
    WORK.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(EXPORT, ignore_errors=True)
    EXPORT.mkdir(parents=True)
    vmlinux, initrd = build_boot()
    rpcbind = start_rpcbind()
    b_id = 7 if VERS == "move" else 8
    servers = [
        start_node_ganesha("node-a", 12049, 12048, 7),
        start_node_ganesha("node-b", 13049, 13048, b_id),
    ]
    proxies = {
        "volexp-a": Proxy("volexp-a", ports=(12049, 12048)),
        "volexp-b": Proxy("volexp-b", ports=(12049, 12048)),
        "volexp-c": Proxy("volexp-c", ports=(13049, 13048)),
    }
    guests: list[Guest] = []
    ok = False
    try:
        for n, pr in proxies.items():
            netns(n)
            await pr.start()
        a = Guest("a", "volexp-a", vmlinux, initrd)
        b = Guest("b", "volexp-b", vmlinux, initrd)
        guests += [a, b]
        for g in (a, b):
            say(f"{g.name}: booted in {await asyncio.to_thread(g.boot):.2f}s")
            st, out = await asyncio.to_thread(g.sh, f"mount -t nfs -o {mount_opts()} 10.0.2.2:vol1 /mnt", 120)
            say(f"{g.name}: mount through node A -> {st} {out[-200:]!r}")
            if st != 0:
                raise SystemExit("mount failed")
        await asyncio.to_thread(
            expect, a, "mkdir -p /mnt/d && echo on-a > /mnt/d/a.txt && cat /mnt/d/a.txt", "on-a"
        )
        await asyncio.to_thread(
            a.sh, "echo kept-open > /mnt/open.txt; exec 7</mnt/open.txt; exec 8>>/mnt/log.txt; echo line1 >&8"
        )
        await asyncio.to_thread(a.sh, "cd /mnt/d")  # a cwd on the volume: its handle too
        snap = WORK / "snap-move"
        shutil.rmtree(snap, ignore_errors=True)
        say(f"a: snapshot in {await asyncio.to_thread(a.snapshot, snap):.2f}s")
        a.kill()
        await proxies["volexp-a"].close()
        c = Guest("c", "volexp-c", vmlinux, initrd)
        guests.append(c)
        say(
            f"a: restored on 'node B' (relay to B's ganesha) in {await asyncio.to_thread(c.restore, snap):.2f}s"
        )
        st, out = await asyncio.to_thread(c.sh, "cat /mnt/d/a.txt", 180, True)
        say(f"a on B: cat /mnt/d/a.txt (a cached handle) -> {st} {out[-200:]!r}")
        st2, out2 = await asyncio.to_thread(
            c.sh, "echo 3 > /proc/sys/vm/drop_caches; ls /mnt; cat /mnt/d/a.txt", 180, True
        )
        say(f"a on B: after dropping caches -> {st2} {out2[-200:]!r}")
        st3, out3 = await asyncio.to_thread(
            c.sh, "cat <&7; echo line2 >&8; cat /mnt/log.txt; ls .", 180, True
        )
        say(f"a on B: open fds and cwd -> {st3} {out3[-200:]!r}")
        st4, out4 = await asyncio.to_thread(
            c.sh, "echo written-on-b > /mnt/d/b.txt && sync && cat /mnt/d/b.txt", 180, True
        )
        say(f"a on B: write -> {st4} {out4[-200:]!r}")
        st5, out5 = await asyncio.to_thread(b.sh, "cat /mnt/d/b.txt /mnt/log.txt", 180, True)
        say(f"b on A: reads it -> {st5} {out5[-200:]!r}")
        await asyncio.to_thread(
            c.sh, "mv /mnt/d/a.txt /mnt/d/renamed.txt; rm /mnt/open.txt; echo x > /mnt/d/new.txt", 180, True
        )
        st7, out7 = await asyncio.to_thread(b.sh, "ls /mnt /mnt/d; cat /mnt/d/renamed.txt", 180, True)
        say(f"b on A: after a rename, a remove and a create on B -> {st7} {out7[-200:]!r}")
        ok = (
            all(x == 0 for x in (st, st2, st3, st4, st5, st7))
            and "written-on-b" in out5
            and "line2" in out5
            and "open.txt" not in out7
            and "a.txt" not in out7
        )
        say(f"MOVE ({VERS}, Export_Id 7 -> {b_id}): {'PASSED' if ok else 'FAILED'}")
        if not ok:
            st6, out6 = await asyncio.to_thread(
                c.sh,
                "umount -f -l /mnt; mount -t nfs -o "
                + mount_opts()
                + " 10.0.2.2:vol1 /mnt; cat /mnt/d/a.txt; cat <&7; ls .",
                180,
                True,
            )
            say(f"a on B: after a lazy umount and a fresh mount -> {st6} {out6[-300:]!r}")
    finally:
        for g in guests:
            g.kill()
        for pr in proxies.values():
            await pr.close()
        for s in servers:
            s.terminate()
            s.wait()
        if rpcbind is not None:
            rpcbind.terminate()
            rpcbind.wait()
        for n in proxies:
            run("ip", "netns", "del", n, check=False)
        (WORK / f"result-{VERS}.log").write_text("\n".join(LOG) + "\n")


if __name__ == "__main__":
    asyncio.run(acl() if VERS == "acl" else move() if VERS.startswith("move") else main())
