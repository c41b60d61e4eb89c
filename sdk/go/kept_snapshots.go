package pal

import (
	"context"
	"net/url"
)

// KeptSnapshot is a snapshot of a VM the tenant keeps (docs/lifecycle.md, "Kept
// snapshots"): out of the VM's retention, past its delete; new VMs start from it.
type KeptSnapshot struct {
	SnapshotID string `json:"snapshotId"`
	Name       string `json:"name,omitempty"`
	SourceVMID string `json:"sourceVmId"`
	CreatedAt  string `json:"createdAt"`
}

// KeepSnapshot keeps a snapshot of the VM, by name unless name is "" (a name taken by
// another kept snapshot moves to this one). The VM runs on, or stays paused.
func (r *RuntimeService) KeepSnapshot(ctx context.Context, vmID, name string) (*KeptSnapshot, error) {
	body := map[string]string{}
	if name != "" {
		body["name"] = name
	}
	var out KeptSnapshot
	return &out, r.c.doJSON(ctx, call{route: routeKeepSnapshot, params: []string{vmID}, json: body}, &out)
}

// KeptSnapshots returns the tenant's kept snapshots, oldest first, of vmID (all of them
// when it is ""), every page.
func (r *RuntimeService) KeptSnapshots(ctx context.Context, vmID string, opts ...ListOption) ([]KeptSnapshot, error) {
	return r.IterKeptSnapshots(vmID, opts...).All(ctx)
}

// IterKeptSnapshots walks the tenant's kept snapshots a page at a time.
func (r *RuntimeService) IterKeptSnapshots(vmID string, opts ...ListOption) *Pager[KeptSnapshot] {
	first := listQuery(opts)
	if vmID != "" {
		first.Set("vmId", vmID)
	}
	return newPager(first, func(ctx context.Context, q url.Values) ([]KeptSnapshot, string, error) {
		var out struct {
			Snapshots  []KeptSnapshot `json:"snapshots"`
			NextCursor *string        `json:"nextCursor"`
		}
		err := r.c.doJSON(ctx, call{route: routeKeptSnapshots, query: q}, &out)
		return out.Snapshots, deref(out.NextCursor), err
	})
}

// KeptSnapshot returns a kept snapshot by id or name (ErrNotFound for another tenant's).
func (r *RuntimeService) KeptSnapshot(ctx context.Context, snapshot string) (*KeptSnapshot, error) {
	var out KeptSnapshot
	return &out, r.c.doJSON(ctx, call{route: routeKeptSnapshot, params: []string{snapshot}}, &out)
}

// DeleteKeptSnapshot lets a kept snapshot go (by id or name); the VMs started from it run on.
func (r *RuntimeService) DeleteKeptSnapshot(ctx context.Context, snapshot string) (*KeptSnapshot, error) {
	var out KeptSnapshot
	return &out, r.c.doJSON(ctx, call{route: routeDeleteKept, params: []string{snapshot}}, &out)
}

// StartFromSnapshot makes count new VMs from a kept snapshot (its memory, disk and
// processes, each VM its own identity), answered as a fork is. Each has the source's
// tags and secrets; StartFromSnapshotWith gives them others.
func (r *RuntimeService) StartFromSnapshot(ctx context.Context, snapshot string, count int) (*ForkResult, error) {
	return r.StartFromSnapshotWith(ctx, snapshot, count, ChildOptions{})
}

// StartFromSnapshotTagged is StartFromSnapshot with each new VM tagged metadata (a
// schedule's tags, the same rules; an empty map: none) instead of the source's tags.
func (r *RuntimeService) StartFromSnapshotTagged(ctx context.Context, snapshot string, count int, metadata map[string]string) (*ForkResult, error) {
	if metadata == nil {
		metadata = map[string]string{}
	}
	return r.StartFromSnapshotWith(ctx, snapshot, count, ChildOptions{Metadata: metadata})
}

// StartFromSnapshotWith is StartFromSnapshot with each new VM given opts: its own tags,
// secrets over the source's.
func (r *RuntimeService) StartFromSnapshotWith(ctx context.Context, snapshot string, count int, opts ChildOptions) (*ForkResult, error) {
	var out ForkResult
	return &out, r.c.doJSON(ctx, call{route: routeStartFromKept, params: []string{snapshot}, json: opts.body(count)}, &out)
}

// ChildOptions is what ForkVMWith and StartFromSnapshotWith give each new VM besides its
// source's settings.
type ChildOptions struct {
	// Metadata tags each new VM instead of the source's tags (a schedule's tags, the same
	// rules); nil: the source's tags, an empty map: none.
	Metadata map[string]string
	// Secrets are set over the source's (a schedule's secrets, the same rules): every exec
	// of the new VM sees them, and the source's it does not override.
	Secrets map[string]Secret
}

type childBody struct {
	Count    int                `json:"count"`
	Metadata *map[string]string `json:"metadata,omitempty"`
	Secrets  map[string]Secret  `json:"secrets,omitempty"`
}

func (o ChildOptions) body(count int) childBody {
	b := childBody{Count: count, Secrets: o.Secrets}
	if o.Metadata != nil {
		b.Metadata = &o.Metadata
	}
	return b
}
