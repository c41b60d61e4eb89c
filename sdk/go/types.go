package pal

import (
	"encoding/json"
	"errors"
	"fmt"
)

// The shapes below follow the server's OpenAPI document (GET /openapi.json), whose JSON
// names they carry. Answer structs may gain fields as the API grows; request structs gain
// only optional ones, so code that builds them keeps compiling.

// AgentSpec is the schedule request. Every field is optional; the zero value schedules the
// "default" image with the server's default limits.
type AgentSpec struct {
	// Image is the guest image's name (Images.List lists them); default "default".
	Image string `json:"image,omitempty"`
	// Isolation is the isolation kind; only "microvm" exists.
	Isolation string `json:"isolation,omitempty"`
	// Limits are the VM's vCPUs, memory, disk and network limits.
	Limits *Limits `json:"limits,omitempty"`
	// Egress is the outbound network policy (EgressNone, EgressOpen, EgressAllow, EgressDeny).
	Egress *Egress `json:"egress,omitempty"`
	// Secrets are environment values for the guest: plain, or brokered (the guest holds a
	// placeholder and the egress gateway inserts the value for the listed hosts only).
	Secrets map[string]Secret `json:"secrets,omitempty"`
	// IdleTimeoutSecs suspends the VM after this long without exec or file requests
	// (0: never); the next request resumes it.
	IdleTimeoutSecs int `json:"idleTimeoutSecs,omitempty"`
	// IdleLivePauseSecs live-pauses an idle VM after this long (0: never).
	IdleLivePauseSecs int `json:"idleLivePauseSecs,omitempty"`
	// WaitPause is the automatic wait management (nil: the server's default).
	WaitPause *WaitPause `json:"waitPause,omitempty"`
	// Boot is how the VM starts ("template", "cold"...; empty: the server chooses).
	Boot string `json:"boot,omitempty"`
	// Placement picks the node (region, labels).
	Placement *Placement `json:"placement,omitempty"`
	// Metadata are the caller's tags (at most 32 keys of [A-Za-z0-9_.:/-], short string
	// values); fork children inherit them, and List(WithMetadata(k, v)) finds them.
	Metadata map[string]string `json:"metadata,omitempty"`
	// LifetimeSecs ends the VM this long after its schedule, busy or not (0: never);
	// RuntimeService.SetLifetime and ExtendLifetime move the end.
	LifetimeSecs int `json:"lifetimeSecs,omitempty"`
	// OnLifetimeEnd is what the end does: "delete" (the default) or "pause".
	OnLifetimeEnd string `json:"onLifetimeEnd,omitempty"`
	// Volumes are the tenant's volumes to mount (docs/volumes.md).
	Volumes []VolumeMount `json:"volumes,omitempty"`
}

// LifetimeUpdate is SetLifetime's change: exactly one of LifetimeSecs (the new lifetime,
// counted from the schedule; a pointer to 0 removes it) and ExtendSecs (added to the current
// end, or to now for a VM without one); OnLifetimeEnd optionally changes what the end does.
type LifetimeUpdate struct {
	LifetimeSecs  *int   `json:"lifetimeSecs,omitempty"`
	ExtendSecs    int    `json:"extendSecs,omitempty"`
	OnLifetimeEnd string `json:"onLifetimeEnd,omitempty"`
}

// Limits are a VM's resources; a zero field takes the server's default.
type Limits struct {
	Vcpus          int  `json:"vcpus,omitempty"`          // virtual CPUs
	MemoryMib      int  `json:"memoryMib,omitempty"`      // guest RAM in MiB
	DiskMib        int  `json:"diskMib,omitempty"`        // writable disk in MiB
	EgressMbps     *int `json:"egressMbps,omitempty"`     // outbound bandwidth cap (nil: none)
	MaxConnections int  `json:"maxConnections,omitempty"` // concurrent outbound connections
	// Disk caps (nil: the server's PAL_DISK_* default), at most its PAL_MAX_DISK_* ceiling.
	DiskReadMibps  *int `json:"diskReadMibps,omitempty"`  // disk read bandwidth, MiB/s
	DiskWriteMibps *int `json:"diskWriteMibps,omitempty"` // disk write bandwidth, MiB/s
	DiskIops       *int `json:"diskIops,omitempty"`       // disk operations per second
}

// LimitsApplied are the host limits a VM's node applied when it last came up: each held
// one and what holds it ("cpu", "memory", "pids", "ioWeight", "diskKernel", "diskQemu"),
// and why each skipped one is missing on that host.
type LimitsApplied struct {
	Applied map[string]string `json:"applied"`
	Skipped map[string]string `json:"skipped"`
}

// WaitPause configures the automatic pause of a VM waiting on the network.
type WaitPause struct {
	AfterMs        int    `json:"afterMs,omitempty"`        // waiting this long pauses it
	OffloadAfterMs *int   `json:"offloadAfterMs,omitempty"` // then its RAM is offloaded
	Deliver        string `json:"deliver,omitempty"`        // "first-byte" or "complete"
	MaxBufferBytes int    `json:"maxBufferBytes,omitempty"` // buffered while paused
}

// Placement constrains which node runs the VM.
type Placement struct {
	Region string            `json:"region,omitempty"`
	Labels map[string]string `json:"labels,omitempty"`
}

// Secret is a value for the guest's environment: a plain Value, or a brokered one when
// Brokered is set.
type Secret struct {
	Value    string
	Brokered *Brokering
}

// Brokering says where the egress gateway inserts a brokered secret.
type Brokering struct {
	Hosts  []string `json:"hosts"`            // the only hosts that receive the value
	Header string   `json:"header,omitempty"` // the header carrying it (default Authorization)
	Format string   `json:"format,omitempty"` // e.g. "Bearer {value}"
}

// MarshalJSON writes a plain secret as a string, a brokered one as an object.
func (s Secret) MarshalJSON() ([]byte, error) {
	if s.Brokered == nil {
		return json.Marshal(s.Value)
	}
	return json.Marshal(struct {
		Value    string     `json:"value"`
		Brokered *Brokering `json:"brokered"`
	}{s.Value, s.Brokered})
}

// Egress is an outbound network policy: Mode "none" or "open", or a list of Allow or Deny
// rules (domains, host:port, CIDRs).
type Egress struct {
	Mode  string   // "none" or "open"; empty when Allow or Deny is set
	Allow []string // only these destinations
	Deny  []string // all but these destinations
}

// EgressNone refuses every outbound connection.
func EgressNone() *Egress { return &Egress{Mode: "none"} }

// EgressOpen allows every outbound connection (internal addresses stay refused).
func EgressOpen() *Egress { return &Egress{Mode: "open"} }

// EgressAllow allows only the given destinations.
func EgressAllow(rules ...string) *Egress { return &Egress{Allow: rules} }

// EgressDeny allows all but the given destinations.
func EgressDeny(rules ...string) *Egress { return &Egress{Deny: rules} }

// MarshalJSON writes the policy as the API takes it: "none", "open", {"allow": [...]} or
// {"deny": [...]}.
func (e Egress) MarshalJSON() ([]byte, error) {
	switch {
	case e.Allow != nil && e.Deny == nil && e.Mode == "":
		return json.Marshal(map[string][]string{"allow": e.Allow})
	case e.Deny != nil && e.Allow == nil && e.Mode == "":
		return json.Marshal(map[string][]string{"deny": e.Deny})
	case e.Allow == nil && e.Deny == nil && e.Mode != "":
		return json.Marshal(e.Mode)
	}
	return nil, errors.New("pal: an Egress is one of a Mode, Allow rules or Deny rules")
}

// UnmarshalJSON reads any of the policy's forms.
func (e *Egress) UnmarshalJSON(data []byte) error {
	*e = Egress{}
	if len(data) > 0 && data[0] == '"' {
		return json.Unmarshal(data, &e.Mode)
	}
	var lists struct {
		Allow []string `json:"allow"`
		Deny  []string `json:"deny"`
	}
	if err := json.Unmarshal(data, &lists); err != nil {
		return fmt.Errorf("pal: egress: %w", err)
	}
	e.Allow, e.Deny = lists.Allow, lists.Deny
	return nil
}

// VM is a sandbox as the server shows it.
type VM struct {
	VMID            string      `json:"vmId"`
	State           string      `json:"state"` // scheduled, running, paused, terminated, failed...
	Image           string      `json:"image"`
	Limits          Limits      `json:"limits"`
	CreatedAt       string      `json:"createdAt"`
	SnapshotID      string      `json:"snapshotId,omitempty"`
	ParentVMID      string      `json:"parentVmId,omitempty"` // set on forks
	Reason          string      `json:"reason,omitempty"`
	IdleTimeoutSecs int         `json:"idleTimeoutSecs"`
	PausedBy        string      `json:"pausedBy,omitempty"`
	BootMethod      string      `json:"bootMethod,omitempty"`
	Egress          *Egress     `json:"egress,omitempty"`
	Network         *Network    `json:"network,omitempty"`
	IdleLivePause   int         `json:"idleLivePauseSecs"`
	WaitPause       *WaitPause  `json:"waitPause,omitempty"`
	Pause           *PauseState `json:"pause,omitempty"`
	LiveStats       *LiveStats  `json:"liveStats,omitempty"`
	// Metadata are the tags given at schedule (or inherited from the fork's source).
	Metadata map[string]string `json:"metadata,omitempty"`
	// ForkedFrom is, for a fork child, the VM it was forked from.
	ForkedFrom string `json:"forkedFrom,omitempty"`
	// LifetimeSecs is its lifetime from its schedule (nil: none, or it ended).
	LifetimeSecs *int `json:"lifetimeSecs,omitempty"`
	// LifetimeEndsAt is when its lifetime ends (RFC 3339; empty: no lifetime).
	LifetimeEndsAt string `json:"lifetimeEndsAt,omitempty"`
	// OnLifetimeEnd is what the lifetime's end does: "delete" or "pause".
	OnLifetimeEnd string `json:"onLifetimeEnd,omitempty"`
	// LimitsApplied are its host limits as its node applied them (nil before it first ran).
	LimitsApplied *LimitsApplied `json:"limitsApplied,omitempty"`
}

// Network is a VM's egress counters.
type Network struct {
	BytesIn     int64 `json:"bytesIn"`
	BytesOut    int64 `json:"bytesOut"`
	Connections int64 `json:"connections"`
	Refused     int64 `json:"refused"`
	DNSQueries  int64 `json:"dnsQueries"`
	Active      *int  `json:"active,omitempty"`
}

// PauseState says how a paused VM is paused.
type PauseState struct {
	Kind        string `json:"kind"` // "snapshot" or "live"
	By          string `json:"by,omitempty"`
	Since       string `json:"since,omitempty"`
	Offloaded   *bool  `json:"offloaded,omitempty"`
	ResidentMiB *int   `json:"residentMiB,omitempty"`
}

// LiveStats counts a VM's live pauses.
type LiveStats struct {
	LivePauses       int64 `json:"livePauses"`
	WaitPauses       int64 `json:"waitPauses"`
	LivePausedMs     int64 `json:"livePausedMs"`
	Offloads         int64 `json:"offloads"`
	FreedMib         int64 `json:"freedMib"`
	BytesWhilePaused int64 `json:"bytesWhilePaused"`
}

// SnapshotState answers PauseVM and ResumeVM.
type SnapshotState struct {
	VMID       string      `json:"vmId"`
	SnapshotID string      `json:"snapshotId,omitempty"` // empty for a live pause
	State      string      `json:"state"`
	Pause      *PauseState `json:"pause,omitempty"`
}

// ForkResult answers ForkVM: each child runs or carries an Error.
type ForkResult struct {
	SourceVMID string      `json:"sourceVmId"`
	SnapshotID string      `json:"snapshotId"`
	Forks      []ForkChild `json:"forks"`
}

// ForkChild is one fork: running, or failed with Error.
type ForkChild struct {
	VMID  string `json:"vmId"`
	State string `json:"state"`
	Error string `json:"error,omitempty"`
}

// ExecRequest runs a command execve-style: Command is the executable and Argv its
// arguments; pass "/bin/sh" with {"-c", line} for a shell line.
type ExecRequest struct {
	Command     string            `json:"command"`
	Argv        []string          `json:"argv"`
	Env         map[string]string `json:"env,omitempty"`
	Cwd         string            `json:"cwd,omitempty"`
	TimeoutSecs float64           `json:"timeoutSecs,omitempty"` // 0: the server's default
	User        string            `json:"user,omitempty"`
	// YieldAfterMs (Exec only): a command still running after this long is answered with
	// Running, its ProcessID, the output so far and Next, and runs on (0: wait to the end).
	YieldAfterMs int `json:"yieldAfterMs,omitempty"`
}

// ExecResult is a finished command's buffered output.
type ExecResult struct {
	ExitCode  int    `json:"exitCode"`
	Stdout    string `json:"stdout"`
	Stderr    string `json:"stderr"`
	TimedOut  bool   `json:"timedOut,omitempty"`
	Truncated bool   `json:"truncated,omitempty"` // output past the server's buffer was cut
	// ProcessID is the command's process: its status and output stay readable through
	// Runtime.Processes.
	ProcessID int64 `json:"processId,omitempty"`
	// Running (YieldAfterMs only): the command still runs; ExitCode is not set yet. Read on
	// with Processes.Output from Next.
	Running bool  `json:"running,omitempty"`
	Next    int64 `json:"next,omitempty"`
}

// FileList lists a directory under /workspace.
type FileList struct {
	Path      string      `json:"path"`
	Entries   []FileEntry `json:"entries"`
	Truncated bool        `json:"truncated"`
}

// FileEntry is one directory entry.
type FileEntry struct {
	Name string `json:"name"`
	Type string `json:"type"` // "file", "dir", "symlink"...
	Size *int64 `json:"size,omitempty"`
}

// FileWritten answers WriteFile.
type FileWritten struct {
	Path         string `json:"path"`
	BytesWritten int64  `json:"bytesWritten"`
}

// FileDeleted answers DeleteFile.
type FileDeleted struct {
	Path    string `json:"path"`
	Deleted bool   `json:"deleted"`
}

// Event is a status change or audit of a VM.
type Event struct {
	At        string                 `json:"at"`
	Kind      string                 `json:"kind"`
	FromState string                 `json:"fromState,omitempty"`
	ToState   string                 `json:"toState,omitempty"`
	Reason    string                 `json:"reason,omitempty"`
	Details   map[string]interface{} `json:"details,omitempty"`
}

// Metrics are a VM's samples of the last 15 minutes.
type Metrics struct {
	VMID         string         `json:"vmId"`
	IntervalSecs float64        `json:"intervalSecs"`
	WindowSecs   float64        `json:"windowSecs"`
	Live         bool           `json:"live"`
	CPUSource    string         `json:"cpuSource,omitempty"`
	Samples      []MetricSample `json:"samples"`
}

// MetricSample is one sample; a nil field was not measured.
type MetricSample struct {
	T                  int64    `json:"t"` // Unix ms
	CPUPct             *float64 `json:"cpuPct,omitempty"`
	RSSBytes           *int64   `json:"rssBytes,omitempty"`
	PSSBytes           *int64   `json:"pssBytes,omitempty"`
	GuestMemUsedBytes  *int64   `json:"guestMemUsedBytes,omitempty"`
	GuestMemTotalBytes *int64   `json:"guestMemTotalBytes,omitempty"`
	DiskUsedBytes      *int64   `json:"diskUsedBytes,omitempty"`
	DiskTotalBytes     *int64   `json:"diskTotalBytes,omitempty"`
	NetRxBytes         *int64   `json:"netRxBytes,omitempty"`
	NetTxBytes         *int64   `json:"netTxBytes,omitempty"`
	LivePausedMs       *int64   `json:"livePausedMs,omitempty"`
}

// Snapshot is one of a VM's snapshots, with its artifacts' sizes.
type Snapshot struct {
	SnapshotID       string           `json:"snapshotId"`
	CreatedAt        string           `json:"createdAt,omitempty"`
	Sizes            map[string]int64 `json:"sizes"`
	Sealed           bool             `json:"sealed"`
	MemoryKind       string           `json:"memoryKind,omitempty"`
	ParentSnapshotID string           `json:"parentSnapshotId,omitempty"`
}

// Image is a guest image the tenant may schedule.
type Image struct {
	Name         string            `json:"name"`
	Digest       string            `json:"digest"`
	Kind         string            `json:"kind"`
	SourceDigest string            `json:"sourceDigest,omitempty"`
	CreatedAt    string            `json:"createdAt,omitempty"`
	SizeBytes    int64             `json:"sizeBytes"`
	User         string            `json:"user,omitempty"`
	Workdir      string            `json:"workdir,omitempty"`
	Env          map[string]string `json:"env,omitempty"`
	Cmd          []string          `json:"cmd,omitempty"`
	WarmSizes    []string          `json:"warmSizes,omitempty"`
}

// PortLink is a signed link to a server in a VM, valid until ExpiresAt (Unix seconds) or
// until RevokePortURL revokes its LinkID.
type PortLink struct {
	URL       string `json:"url"`
	ExpiresAt int64  `json:"expiresAt"`
	LinkID    string `json:"linkId"`
}

// PortLinkRevoked answers RevokePortURL.
type PortLinkRevoked struct {
	LinkID  string `json:"linkId"`
	Revoked bool   `json:"revoked"`
}

// SecretRotated answers RotateSecret: Applied is "now" (a running VM's next request
// carries it) or "next start".
type SecretRotated struct {
	Name    string `json:"name"`
	Applied string `json:"applied"`
}

// Health answers Client.Health.
type Health struct {
	OK bool `json:"ok"`
}

// VolumeMount is a volume an AgentSpec mounts: the tenant's volume by name or id, at an
// absolute path in the guest, read-only or not (the server enforces it).
type VolumeMount struct {
	Name     string `json:"name"`
	Path     string `json:"path"`
	ReadOnly bool   `json:"readOnly,omitempty"`
}
