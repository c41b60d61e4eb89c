"""Every verb of the node RPC, declared once: its request and answer types, its kind, its
route, and what it promises (prerequisites / success / failure, as Firecracker's
``rpc_interface.rs`` documents each action).

From a declaration come:

- the node's route (pal/manager/rpc.py serves every verb of :data:`VERBS` from the node's
  handler table, :class:`pal.wire.handlers.Handlers`);
- the control plane's call, typed by it: ``await node.call(verbs.SPAWN, SpawnRequest(...))``
  answers a ``SpawnResult`` (:class:`pal.wire.handlers.NodeCalls`, implemented by the one
  HTTP client, pal/scheduler/node_client.py, for the embedded node and remote ones alike);
- how it travels (pal/wire/http.py: the path from the request's fields, the rest in the
  query or the body);
- its share of the node's connections: a **control** call has connections no long-lived
  call takes; a **long** one (a long poll, a kernel's start) and every stream hold one of
  the node's stream slots while they last (pal/scheduler/node_client.py, "Fair shares");
- for a **guest** verb (``guest=``), the node's handler itself: the request goes to the
  guest's harness as its kind with the request's fields, the guest's error codes map
  through guest_errors.py's table for ``errors``, and its answer is validated as the
  verb's answer model (pal/manager/guest_relay.py). Such a verb needs no node-side code.

Failures are :class:`pal.errors.PalError` subclasses carrying the status the API answers.
"""

from __future__ import annotations

from pal.wire import code as c
from pal.wire import file_metadata as fm
from pal.wire import models as m
from pal.wire import processes as pr
from pal.wire import volumes as vol
from pal.wire.verb_kinds import DEFAULT_TIMEOUT_S as DEFAULT_TIMEOUT_S
from pal.wire.verb_kinds import GUEST_REQUEST_TIMEOUT_S as GUEST_REQUEST_TIMEOUT_S
from pal.wire.verb_kinds import LONG_POLL_SLACK_S as LONG_POLL_SLACK_S
from pal.wire.verb_kinds import Call as Call
from pal.wire.verb_kinds import GuestOp as GuestOp
from pal.wire.verb_kinds import Stream as Stream
from pal.wire.verb_kinds import Tunnel as Tunnel
from pal.wire.verb_kinds import Verb as Verb
from pal.wire.verb_kinds import guest_doc as _guest

# ---------------------------------------------------------------------- a VM's life
SPAWN = Call(
    "spawn",
    "POST",
    "/vms",
    m.SpawnRequest,
    m.SpawnResult,
    "Boot (cold or from a warm template) or restore a VM. Prerequisites: no live VM with its id "
    "here. Success: its harness answered identify as that VM and incarnation; exec works. "
    "Failure: no QEMU left running, its live files removed; the snapshot restored from (if "
    "any) untouched.",
    # It waits its turn for free CPU (restore_gate.py), then ends by the node's own deadlines
    # (identify in CPU time, QMP, migration); a node that dies closes it.
    timeout_s=None,
)
STOP = Call(
    "stop",
    "DELETE",
    "/vms/{vmId}",
    m.StopVm,
    m.Stopped,
    "Kill the VM's QEMU and remove its live files. Idempotent (an unknown id: nothing done). "
    "With ``incarnation``: only if the VM here runs that incarnation (stray cleanup never "
    "stops a newer one; ``stopped`` false).",
)
SNAPSHOT = Call(
    "snapshot",
    "POST",
    "/vms/{vmId}/snapshot",
    m.SnapshotRequest,
    m.SnapshotResult,
    "Capture device state, memory and disk at one instant. Prerequisites: the VM is live here. "
    "Success: a complete, checksummed snapshot is in place; with ``keepRunning`` the guest "
    "continues, else its QEMU is gone (or parked); retention ran, keeping ``protected``. "
    "Failure: no snapshot with that id exists; the guest runs again if its QEMU is alive.",
)
LIVE_PAUSE = Call(
    "live_pause",
    "POST",
    "/vms/{vmId}/live-pause",
    m.LivePauseRequest,
    m.LivePauseResult,
    "Stop the VM's vCPUs in place (docs/live-pause.md). Prerequisites: the VM is live here. "
    "Success: its vCPUs stopped, the gateway holds its connections, the pause recorded on the "
    "node; with ``offload`` its RAM handed back (or later, ``offloadAfterMs``). Already "
    "live-paused: ``by: operator`` takes it over, ``offload`` offloads it. ``paused`` false: an "
    "``ifWaiting`` pause found nothing waiting or the guest busy; nothing changed. "
    "Failure: the VM runs as before.",
)
LIVE_RESUME = Call(
    "live_resume",
    "POST",
    "/vms/{vmId}/live-resume",
    m.VmRef,
    m.LiveResumeResult,
    "Continue a live-paused VM: the same QEMU and incarnation, connections kept. "
    "Prerequisites: the VM is live here. Success: its vCPUs run, its wall clock is the "
    "host's, the gateway delivered what it held; ``resumed`` false if it was not live-paused. "
    "Failure: its QEMU is gone.",
)
LIVE_STATUS = Call(
    "live_status",
    "GET",
    "/vms/{vmId}/live",
    m.VmRef,
    m.LiveStatus,
    "The VM's live pause (null while it runs), resident guest RAM measured now.",
    timeout_s=10.0,
)
NOTICES = Call(
    "notices",
    "GET",
    "/notices",
    m.NoticesAfter,
    m.Notices,
    "What the node saw for the scheduler to act on (wait-ready, wake, offloaded), newer than "
    "``after`` (all kept ones if ``epoch`` is not the node's numbering); waits up to "
    "``waitS`` for one (long poll; the control plane's own, one per node: a control call).",
    timeout_s=lambda r: r.wait_s + 30.0,
)
WARM = Call(
    "warm",
    "POST",
    "/templates",
    m.WarmRequest,
    m.WarmResult,
    "Build the warm template of an image at a size now. Prerequisites: the image exists, "
    "templates are on (else 503). Success: ``ready`` and schedules of that image and size "
    "restore from it. Failure: ``ready`` false (the next schedule retries it).",
    timeout_s=900.0,  # a cold boot: a minute or more under TCG on a busy host
)
HEARTBEAT = Call(
    "heartbeat",
    "GET",
    "/heartbeat",
    m.Empty,
    m.NodeHeartbeat,
    "This node's live VMs and each one's latest activity, and what placement needs: capacity, "
    "warm templates, images, health, region, labels.",
    timeout_s=15.0,  # a node slower than this is as good as silent (reconciliation must not hang)
)
IMAGES = Call(
    "images",
    "GET",
    "/images",
    m.Empty,
    m.ImageList,
    "The complete images of this node: content digest, exec defaults, which tenants may use "
    "each (null: all), warm template sizes.",
)
VM_METRICS = Call(
    "vm_metrics",
    "GET",
    "/vms/{vmId}/metrics",
    m.VmRef,
    m.VmMetrics,
    "The VM's resource samples of the last 15 minutes, oldest first (pal/manager/metrics.py); "
    "empty for a VM this node never ran; ``live``: it runs here now.",
)
STATS = Call(
    "stats",
    "GET",
    "/stats",
    m.Empty,
    m.NodeStats,
    "Operator figures of the node: live VMs, snapshot bytes per tier, queue depths, the warm "
    "pool and the pre-started QEMUs.",
)

# ---------------------------------------------------------------------- egress
SET_EGRESS = Call(
    "set_egress",
    "PUT",
    "/vms/{vmId}/egress",
    m.EgressSet,
    m.EgressSetResult,
    "Change a live VM's egress policy and limits. Prerequisites: the VM is live here. Success: "
    "new connections follow it at once, open ones it refuses are reset (``closed``); a "
    "restarted node keeps it. Failure: the previous policy stays in force.",
)
SET_BROKERED = Call(
    "set_brokered",
    "PUT",
    "/vms/{vmId}/brokered",
    m.BrokeredSet,
    m.BrokeredSetResult,
    "New values for a live VM's brokered secrets (rotation). Prerequisites: the VM is live "
    "here (else 409). Success: the gateway puts them into the VM's next requests (on open "
    "connections too); nothing in the guest changes. Failure: the previous values stay.",
)
EGRESS_COUNTERS = Call(
    "egress_counters",
    "GET",
    "/vms/{vmId}/egress",
    m.VmRef,
    m.EgressCounters,
    "The current incarnation's gateway counters; null when the gateway cannot tell.",
    timeout_s=5.0,
)
EGRESS_EVENTS = Call(
    "egress_events",
    "GET",
    "/egress/events",
    m.EventsAfter,
    m.EgressEvents,
    "egress_denied events newer than ``after`` (all kept ones if ``epoch`` is not the "
    "gateway's numbering); the gateway keeps the newest 2000.",
)

# ---------------------------------------------------------------------- snapshots kept
SNAPSHOT_OWNERS = Call(
    "snapshot_owners",
    "GET",
    "/snapshots",
    m.Empty,
    m.SnapshotOwners,
    "Which VMs have snapshots on the node's tiers (the control plane's sweep).",
)
LIST_SNAPSHOTS = Call(
    "list_snapshots",
    "GET",
    "/snapshots/{agentVersionId}/{vmId}",
    m.VmSnapshots,
    m.SnapshotList,
    "The VM's complete local snapshots, oldest first, with their sizes.",
)
DELETE_VM_SNAPSHOTS = Call(
    "delete_vm_snapshots",
    "DELETE",
    "/snapshots/{agentVersionId}/{vmId}",
    m.VmSnapshotsDelete,
    m.SnapshotsDeleted,
    "Delete every snapshot of a VM, local and S3, except ``keep`` and what a live fork on the "
    "node maps. Idempotent. Answers the local snapshot ids deleted.",
)
SNAPSHOT_STATUS = Call(
    "snapshot_status",
    "GET",
    "/snapshots/{agentVersionId}/{vmId}/{snapshotId}",
    m.SnapshotAt,
    m.SnapshotStatus,
    "Whether a snapshot is complete and verified (local or S3): reconciliation's question.",
)
ENSURE_UPLOADED = Call(
    "ensure_uploaded",
    "POST",
    "/snapshots/{agentVersionId}/{vmId}/{snapshotId}/upload",
    m.SnapshotAt,
    m.Uploaded,
    "Make the snapshot restorable on any node. Prerequisites: it is complete here (or in S3); "
    "S3 is set. Success: S3 holds a sealed, complete copy. Failure: 503 (no S3, S3 down), 404 "
    "(no such snapshot here or in S3); nothing changes locally.",
)
DELETE_SNAPSHOT = Call(
    "delete_snapshot",
    "DELETE",
    "/snapshots/{agentVersionId}/{vmId}/{snapshotId}",
    m.SnapshotAt,
    m.SnapshotDeleted,
    "Delete a snapshot on both tiers.",
)

# ---------------------------------------------------------------------- volumes
# A volume's files on the node that holds them (docs/volumes.md; pal/manager/volumes.py).
CREATE_VOLUME = Call(
    "create_volume",
    "POST",
    "/volumes",
    vol.VolumeCreate,
    vol.VolumeInfo,
    "Make a volume's storage. Idempotent: a volume of that id and tenant already there is "
    "answered as it is (409 if another tenant's). Success: its directory exists, empty when "
    "new, and its size is recorded. Failure: nothing of it is left.",
)
RESIZE_VOLUME = Call(
    "resize_volume",
    "POST",
    "/volumes/{volumeId}/resize",
    vol.VolumeResize,
    vol.VolumeInfo,
    "Grow a volume to ``sizeMib`` (400 for a smaller size, 404 for no such volume). Success: "
    "the new size is recorded. Failure: the old size stays.",
)
DELETE_VOLUME = Call(
    "delete_volume",
    "DELETE",
    "/volumes/{volumeId}",
    vol.VolumeRef,
    vol.VolumeDeleted,
    "Delete a volume's storage, its files with it. Idempotent (``deleted`` false: nothing was "
    "there). Success: nothing of it is left on the node.",
)

_VOLUME_PATH = (
    "``path`` is relative to the volume's root and walked without following a symlink "
    "(400 PATH_ESCAPE for a symlink on the way, ``..`` or an absolute path; 404 "
    "FILE_NOT_FOUND; 404 for a volume the node does not hold)."
)
VOLUME_LIST = Call(
    "volume_list",
    "GET",
    "/volumes/{volumeId}/files",
    vol.VolumeList,
    vol.VolumeListing,
    "A directory of a volume, ``depth`` levels down, breadth first, as lstat sees each entry "
    "(at most 1000: ``truncated``). " + _VOLUME_PATH,
)
VOLUME_STAT = Call(
    "volume_stat",
    "GET",
    "/volumes/{volumeId}/files/stat",
    vol.VolumePath,
    vol.VolumeEntry,
    "What is at a path of a volume, not followed (a symlink is a symlink, with its target). " + _VOLUME_PATH,
)
VOLUME_READ = Call(
    "volume_read",
    "GET",
    "/volumes/{volumeId}/files/content",
    vol.VolumePath,
    vol.VolumeContent,
    "A regular file's bytes, cut at 1 MiB (``truncated``); a fifo, device or socket is never "
    "opened (400). " + _VOLUME_PATH,
)
VOLUME_WRITE = Call(
    "volume_write",
    "PUT",
    "/volumes/{volumeId}/files/content",
    vol.VolumeWrite,
    vol.VolumeWritten,
    "Write a file (at most 1 MiB; 413), its missing parents made, all the workload user's. "
    "Success: the new file renamed over what was there (never written through: a hard link "
    "or symlink there is replaced), synced. Failure: nothing changes; 507 when the volume "
    "would pass its sizeMib. " + _VOLUME_PATH,
)
VOLUME_MKDIR = Call(
    "volume_mkdir",
    "POST",
    "/volumes/{volumeId}/files/dir",
    vol.VolumeMkdir,
    vol.VolumeMade,
    "Make a directory (``parents``: its missing parents too, and no error if it is there; "
    "else 400 when it exists). " + _VOLUME_PATH,
)
VOLUME_REMOVE = Call(
    "volume_remove",
    "DELETE",
    "/volumes/{volumeId}/files/content",
    vol.VolumeRemove,
    vol.VolumeRemoved,
    "Remove a file or symlink (the link, not its target); a directory only with "
    "``recursive`` (else 400), removed without following a symlink in it. " + _VOLUME_PATH,
)
VOLUME_SET_ATTRS = Call(
    "volume_set_attrs",
    "POST",
    "/volumes/{volumeId}/files/attrs",
    vol.VolumeAttrs,
    vol.VolumeEntry,
    "Change a file's or directory's ``mode``, ``uid``, ``gid`` (those given), through a "
    "descriptor of it: never a symlink (400). Answers it as stat does. " + _VOLUME_PATH,
)

# ---------------------------------------------------------------------- in the guest
EXEC = Stream(
    "exec",
    "POST",
    "/vms/{vmId}/exec",
    m.ExecCall,
    m.ExecEvent,
    "Run a command: ``process`` first, then stdout/stderr as they come, then ``exit``, or an "
    "``error`` (the guest's code, or the node's own with its status). " + _guest("exec"),
)
PORT = Tunnel(
    "port",
    "/vms/{vmId}/ports/{port}",
    m.PortOpen,
    "A byte stream to the server listening on ``port`` in the guest (0.0.0.0 or 127.0.0.1); "
    "traffic on it is the VM's activity. Prerequisites: the VM runs here (409, 409 "
    "LIVE_PAUSED). Failure: 502 PORT_NOT_LISTENING when nothing listens there; nothing is "
    "left open.",
)
LIST_FILES = Call(
    "list_files",
    "GET",
    "/vms/{vmId}/files",
    m.FilesAt,
    m.FileList,
    "A directory under /workspace. " + _guest("file"),
)
READ_FILE = Call(
    "read_file",
    "GET",
    "/vms/{vmId}/files/content",
    m.FileRef,
    m.FileContent,
    "A file's bytes, cut at 1 MiB (``truncated``). " + _guest("file"),
)
WRITE_FILE = Call(
    "write_file",
    "PUT",
    "/vms/{vmId}/files/content",
    m.FileWrite,
    m.FileWritten,
    "Write a file (at most 1 MiB); with ``metadata``, its E2B metadata replaced too (400 as "
    "SET_FILE_METADATA's). " + _guest("file"),
)
DELETE_FILE = Call(
    "delete_file",
    "DELETE",
    "/vms/{vmId}/files/content",
    m.FileRef,
    m.FileDeleted,
    "Remove a file or symlink (404 FILE_NOT_FOUND, 400 for a directory). " + _guest("file"),
)
# E2B's file metadata (pal/guest/xattrs.py): ``user.e2b.*`` xattrs of any path of the guest.
FILE_METADATA = Call(
    "file_metadata",
    "POST",
    "/vms/{vmId}/files/metadata/read",
    fm.FileMetadataOf,
    fm.FileMetadataList,
    "The metadata of up to 1000 absolute paths, one map each in order ({} for a missing file, "
    "a link, or a file system without user xattrs). " + _guest("file"),
    guest=GuestOp("xget", "file"),
)
SET_FILE_METADATA = Call(
    "set_file_metadata",
    "PUT",
    "/vms/{vmId}/files/metadata",
    fm.FileMetadataSet,
    fm.FileMetadataDone,
    "Replace a file's metadata with ``metadata`` ({}: clear it); on a failure it has none. "
    "400 for a file system without user xattrs (tmpfs here) or metadata beyond its xattr space. "
    + _guest("file"),
    guest=GuestOp("xset", "file"),
)
# Directory watches (pal/guest/watches.py): inotify in the guest, bounded, kept across a pause.
CREATE_WATCH = Call(
    "create_watch",
    "POST",
    "/vms/{vmId}/watches",
    m.WatchNew,
    m.WatchMade,
    "Watch a directory of the guest (any path; ``recursive``: the directories under it too, "
    "as they appear). 404 for a missing directory, 400 for a file, 429 past 16 watches. " + _guest("file"),
    guest=GuestOp("wnew", "file"),
)
READ_WATCH = Call(
    "read_watch",
    "GET",
    "/vms/{vmId}/watches/{watchId}",
    m.WatchRead,
    m.WatchEvents,
    "Its events since the last read (waiting up to ``waitMs`` for one: a long poll), and how "
    "many its bound dropped. 404 for no such watch. " + _guest("file"),
    guest=GuestOp("wread", "file", counted=False),
    long=lambda r: r.wait_ms > 0,
    timeout_s=lambda r: r.wait_ms / 1000 + LONG_POLL_SLACK_S,
)
DELETE_WATCH = Call(
    "delete_watch",
    "DELETE",
    "/vms/{vmId}/watches/{watchId}",
    m.WatchRef,
    m.WatchDeleted,
    "Stop watching (404 for no such watch). " + _guest("file"),
    guest=GuestOp("wdel", "file"),
)
RENAME_USER = Call(
    "rename_user",
    "PUT",
    "/vms/{vmId}/user",
    m.WorkloadUserName,
    m.WorkloadUserNamed,
    "The workload user (its uid) takes ``name`` in passwd, group and their shadows, with home "
    "``home``, a bind mount of /workspace: E2B's `user` (pal/e2b/conventions.py), done by the "
    "harness with no process. Idempotent. " + _guest("exec"),
    guest=GuestOp("urename", "exec"),
)

# Processes (docs/processes.md; the node side: pal/manager/processes.py).
START_PROCESS = Call(
    "start_process",
    "POST",
    "/vms/{vmId}/processes",
    pr.ProcessStart,
    pr.ProcessInfo,
    "Start a process that outlives the request. Success: it runs (a missing executable is "
    "400, as for exec). " + _guest("exec"),
)
START_ATTACHED = Stream(
    "start_attached",
    "POST",
    "/vms/{vmId}/processes/started",
    pr.ProcessStart,
    pr.StartedEvent,
    "Start a process (as ``start_process``) and follow its output from its first byte in the "
    "same guest request: ``started`` (its id), then ``attach_process``'s events. A stream that "
    "ends early leaves the process running (as an attach). " + _guest("exec"),
)
LIST_PROCESSES = Call(
    "list_processes",
    "GET",
    "/vms/{vmId}/processes",
    m.VmRef,
    pr.ProcessList,
    "The VM's processes, running and recently exited. " + _guest("process"),
)
GET_PROCESS = Call(
    "get_process",
    "GET",
    "/vms/{vmId}/processes/{pid}",
    pr.ProcessRef,
    pr.ProcessInfo,
    "One process (404 PROCESS_NOT_FOUND). " + _guest("process"),
)
DELETE_PROCESS = Call(
    "delete_process",
    "DELETE",
    "/vms/{vmId}/processes/{pid}",
    pr.ProcessRef,
    pr.ProcessDeleted,
    "Kill it (its group) if it runs, and forget it. " + _guest("process"),
)
READ_OUTPUT = Call(
    "read_output",
    "GET",
    "/vms/{vmId}/processes/{pid}/output",
    pr.OutputRead,
    pr.ProcessOutput,
    "Its journal from ``from`` (waiting up to ``waitMs`` for output past it: a long poll); "
    "400 when ``from`` is past the output's end. " + _guest("process"),
    long=lambda r: r.wait_ms > 0,
    timeout_s=lambda r: r.wait_ms / 1000 + LONG_POLL_SLACK_S,
)
ATTACH_PROCESS = Stream(
    "attach_process",
    "GET",
    "/vms/{vmId}/processes/{pid}/attach",
    pr.AttachFrom,
    pr.ProcessEvent,
    "Its output from ``from`` as it comes; ends with ``exit``, or ``detached`` (the VM stopped, "
    "a live pause, the guest detached it), never a made-up exit. " + _guest("process"),
)
WRITE_STDIN = Call(
    "write_stdin",
    "POST",
    "/vms/{vmId}/processes/{pid}/stdin",
    pr.StdinWrite,
    pr.StdinWritten,
    "Raw bytes to its stdin (at most 1 MiB); ``written`` fewer than sent: it read nothing for a "
    "while (send the rest again); ``eof`` closes it after them. " + _guest("process"),
)
SIGNAL_PROCESS = Call(
    "signal_process",
    "POST",
    "/vms/{vmId}/processes/{pid}/signal",
    pr.ProcessSignal,
    pr.SignalSent,
    "A signal to its process group (409 PROCESS_STATE once it exited). " + _guest("process"),
)
RESIZE_PROCESS = Call(
    "resize_process",
    "POST",
    "/vms/{vmId}/processes/{pid}/resize",
    pr.ProcessResize,
    pr.Resized,
    "Resize its terminal (409 PROCESS_STATE without one). " + _guest("process"),
)
WAIT_PROCESS = Call(
    "wait_process",
    "POST",
    "/vms/{vmId}/processes/{pid}/wait",
    pr.ProcessWait,
    pr.ProcessInfo,
    "The process once it exited, or at the timeout (at most 60 s: a long poll). " + _guest("process"),
    long=lambda r: r.timeout_ms > 0,
    timeout_s=lambda r: r.timeout_ms / 1000 + LONG_POLL_SLACK_S,
)

PROCESS_STATS = Call(
    "process_stats",
    "GET",
    "/vms/{vmId}/processes/{pid}/stats",
    pr.ProcessRef,
    pr.ProcessStats,
    "Its CPU time, resident memory, threads and state from the guest's /proc, now (the process "
    "itself; null figures once it ended). " + _guest("process"),
    guest=GuestOp("pstats", "process"),
)

# Code contexts (docs/agents.md; the node side: pal/manager/code.py): as processes, with 404
# CONTEXT_NOT_FOUND, 409 CONTEXT_BUSY / KERNEL_UNAVAILABLE, 429 TOO_MANY_CONTEXTS.
RUN_CODE = Stream(
    "run_code",
    "POST",
    "/vms/{vmId}/code",
    c.CodeRun,
    c.CodeEvent,
    "A cell's stdout/stderr/result/error events, then ``end``. " + _guest("code"),
)
CREATE_CONTEXT = Call(
    "create_context",
    "POST",
    "/vms/{vmId}/code/contexts",
    c.ContextNew,
    c.CodeContext,
    "A context, once its kernel started (minutes under TCG: long-lived). " + _guest("code"),
    long=True,
)
LIST_CONTEXTS = Call(
    "list_contexts",
    "GET",
    "/vms/{vmId}/code/contexts",
    m.VmRef,
    c.ContextList,
    "The VM's code contexts. " + _guest("code"),
)
DELETE_CONTEXT = Call(
    "delete_context",
    "DELETE",
    "/vms/{vmId}/code/contexts/{contextId}",
    c.ContextRef,
    c.ContextDeleted,
    "Kill its kernel and forget it. " + _guest("code"),
)
RESTART_CONTEXT = Call(
    "restart_context",
    "POST",
    "/vms/{vmId}/code/contexts/{contextId}/restart",
    c.ContextRef,
    c.ContextRestarted,
    "Kill its kernel and start a fresh one under the same id, language, cwd and environment "
    "(its variables are gone; a running cell ends as lost). Long-lived: a kernel's start. " + _guest("code"),
    long=True,
)
INTERRUPT_CONTEXT = Call(
    "interrupt_context",
    "POST",
    "/vms/{vmId}/code/contexts/{contextId}/interrupt",
    c.ContextRef,
    c.ContextInterrupted,
    "Interrupt its running cell (``interrupted`` false: none ran). " + _guest("code"),
)

# Every verb above, in the order declared: the node serves each (pal/manager/rpc.py).
VERBS: tuple[Verb, ...] = tuple(v for v in list(globals().values()) if isinstance(v, Call | Stream | Tunnel))
