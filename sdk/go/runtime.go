package pal

import (
	"context"
	"strconv"
	"time"
)

// RuntimeService holds the /v1/runtime calls (Client.Runtime). Every call takes a context:
// cancelling it abandons the call.
type RuntimeService struct {
	// Processes holds the calls on a VM's processes: background commands, their output
	// (reattaching), stdin, signals, terminals (processes.go).
	Processes *ProcessesService

	c *Client
}

// Schedule starts a sandbox microVM (ErrQuota when the tenant is full).
func (r *RuntimeService) Schedule(ctx context.Context, spec AgentSpec) (*VM, error) {
	var out VM
	return &out, r.c.doJSON(ctx, call{route: routeSchedule, json: spec}, &out)
}

// Get returns a VM (ErrNotFound for an unknown one or another tenant's).
func (r *RuntimeService) Get(ctx context.Context, vmID string) (*VM, error) {
	var out VM
	return &out, r.c.doJSON(ctx, call{route: routeGetVM, params: []string{vmID}}, &out)
}

// List returns the tenant's VMs, every page (WithMetadata filters, WithPageSize sizes the
// requests); IterVMs walks them a page at a time.
func (r *RuntimeService) List(ctx context.Context, opts ...ListOption) ([]VM, error) {
	return r.IterVMs(opts...).All(ctx)
}

// Delete stops a VM for good (state terminated) and releases its snapshots.
func (r *RuntimeService) Delete(ctx context.Context, vmID string) (*VM, error) {
	var out VM
	return &out, r.c.doJSON(ctx, call{route: routeDeleteVM, params: []string{vmID}}, &out)
}

// PauseOption chooses the kind of pause (PauseVM's arguments).
type PauseOption func(*pauseBody)

type pauseBody struct {
	Mode    string `json:"mode"`
	Offload bool   `json:"offload"`
}

// PauseLive pauses in place: the vCPUs stop, the VM keeps its process, connections and
// quota slot; with offload its RAM is also handed back to the host.
func PauseLive(offload bool) PauseOption {
	return func(b *pauseBody) { b.Mode, b.Offload = "live", offload }
}

// PauseVM pauses a VM. By default it snapshots memory and disk, stops the VM and frees its
// quota slot; PauseLive pauses it in place instead. An operator-paused VM is never resumed
// by a request (exec answers ErrConflict) until ResumeVM.
func (r *RuntimeService) PauseVM(ctx context.Context, vmID string, opts ...PauseOption) (*SnapshotState, error) {
	k := call{route: routePause, params: []string{vmID}}
	if len(opts) > 0 {
		body := pauseBody{Mode: "snapshot"}
		for _, o := range opts {
			o(&body)
		}
		k.json = body
	}
	var out SnapshotState
	return &out, r.c.doJSON(ctx, k, &out)
}

// ResumeVM continues a paused VM under the same id: a live-paused one in place, a
// snapshot-paused one restored (ErrQuota over quota, ErrConflict when not paused).
func (r *RuntimeService) ResumeVM(ctx context.Context, vmID string) (*SnapshotState, error) {
	var out SnapshotState
	return &out, r.c.doJSON(ctx, call{route: routeResume, params: []string{vmID}}, &out)
}

// ForkVM makes count copy-on-write copies of a VM, all or nothing on quota (ErrQuota).
// Each child is running or carries an Error.
func (r *RuntimeService) ForkVM(ctx context.Context, vmID string, count int) (*ForkResult, error) {
	return r.ForkVMWith(ctx, vmID, count, ChildOptions{})
}

// ForkVMWith is ForkVM with each child given opts: its own tags (instead of the source's),
// secrets over the source's.
func (r *RuntimeService) ForkVMWith(ctx context.Context, vmID string, count int, opts ChildOptions) (*ForkResult, error) {
	var out ForkResult
	return &out, r.c.doJSON(ctx, call{route: routeFork, params: []string{vmID}, json: opts.body(count)}, &out)
}

// Exec runs a command and waits for it to end. A command that exits non-zero is not an
// error: read ExitCode. The server bounds the command (req.TimeoutSecs); ctx bounds the
// wait.
func (r *RuntimeService) Exec(ctx context.Context, vmID string, req ExecRequest) (*ExecResult, error) {
	var out ExecResult
	k := call{route: routeExec, params: []string{vmID}, json: execBody(req), stream: true}
	return &out, r.c.doJSON(ctx, k, &out)
}

// execBody sends an absent Argv as [] (the API's argv is a list).
func execBody(req ExecRequest) ExecRequest {
	if req.Argv == nil {
		req.Argv = []string{}
	}
	return req
}

// SetEgress changes a VM's egress policy: a running VM's next connection follows it, and
// its open connections the new policy refuses are reset. Returns the VM.
func (r *RuntimeService) SetEgress(ctx context.Context, vmID string, egress *Egress) (*VM, error) {
	body := struct {
		Egress *Egress `json:"egress"`
	}{egress}
	var out VM
	return &out, r.c.doJSON(ctx, call{route: routeSetEgress, params: []string{vmID}, json: body}, &out)
}

// RotateSecret gives a brokered secret a new value; the VM's next request carries it (the
// guest, which holds only the placeholder, is not touched).
func (r *RuntimeService) RotateSecret(ctx context.Context, vmID, name, value string) (*SecretRotated, error) {
	body := struct {
		Value string `json:"value"`
	}{value}
	var out SecretRotated
	k := call{route: routeRotateSecret, params: []string{vmID, name}, json: body}
	return &out, r.c.doJSON(ctx, k, &out)
}

// PortURL signs a link to the server listening on port in the VM, which opens it without
// the API key until it expires or is revoked (RevokePortURL); bound to this VM and port,
// on an origin of its own. expiresIn is rounded down to
// seconds; 0 means the server's default of one hour.
func (r *RuntimeService) PortURL(ctx context.Context, vmID string, port int, expiresIn time.Duration) (*PortLink, error) {
	secs := int(expiresIn / time.Second)
	if secs <= 0 {
		secs = 3600
	}
	body := struct {
		ExpiresInSecs int `json:"expiresInSecs"`
	}{secs}
	var out PortLink
	k := call{route: routePortURL, params: []string{vmID, strconv.Itoa(port)}, json: body}
	return &out, r.c.doJSON(ctx, k, &out)
}

// RevokePortURL revokes a link PortURL made (its LinkID): it opens nothing from now on,
// on every replica. Revoking again is fine.
func (r *RuntimeService) RevokePortURL(ctx context.Context, vmID, linkID string) (*PortLinkRevoked, error) {
	var out PortLinkRevoked
	return &out, r.c.doJSON(ctx, call{route: routeRevokeLink, params: []string{vmID, linkID}}, &out)
}

// Events returns a VM's status events and audits, oldest first, every page (IterEvents
// walks them a page at a time).
func (r *RuntimeService) Events(ctx context.Context, vmID string, opts ...ListOption) ([]Event, error) {
	return r.IterEvents(vmID, opts...).All(ctx)
}

// Metrics returns a VM's CPU, memory, disk and network samples of the last 15 minutes
// (one every 5 s).
func (r *RuntimeService) Metrics(ctx context.Context, vmID string) (*Metrics, error) {
	var out Metrics
	return &out, r.c.doJSON(ctx, call{route: routeMetrics, params: []string{vmID}}, &out)
}

// Snapshots returns the VM's snapshots kept on its node, with each artifact's size, every
// page (IterSnapshots walks them a page at a time).
func (r *RuntimeService) Snapshots(ctx context.Context, vmID string, opts ...ListOption) ([]Snapshot, error) {
	return r.IterSnapshots(vmID, opts...).All(ctx)
}

// ImagesService lists images (Client.Images).
type ImagesService struct {
	c *Client
}

// List returns the images this tenant may schedule (AgentSpec.Image), every page.
func (s *ImagesService) List(ctx context.Context, opts ...ListOption) ([]Image, error) {
	return s.Iter(opts...).All(ctx)
}
