package pal

// The contract's metadata, lifetime and pagination scenarios (see contract_test.go).

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/url"
	"reflect"
	"testing"
	"time"
)

func unique(t *testing.T) string {
	b := make([]byte, 6)
	_, err := rand.Read(b)
	must(t, err)
	return hex.EncodeToString(b)
}

func vmIDs(vms []VM) []string {
	out := []string{}
	for _, v := range vms {
		out = append(out, v.VMID)
	}
	return out
}

func scenarioMetadata(t *testing.T, ctx context.Context, st *contract) {
	run := unique(t)
	tags := map[string]string{"sdk": "go", "run": run}
	m, err := st.c.Runtime.Schedule(ctx, AgentSpec{Metadata: tags})
	must(t, err)
	defer st.c.Runtime.Delete(context.Background(), m.VMID) //nolint:errcheck // also after a failure
	got, err := st.c.Runtime.Get(ctx, m.VMID)
	must(t, err)
	if !reflect.DeepEqual(got.Metadata, tags) {
		t.Fatalf("%+v", got)
	}
	fork, err := st.c.Runtime.ForkVM(ctx, m.VMID, 1)
	must(t, err)
	child := fork.Forks[0].VMID
	defer st.c.Runtime.Delete(context.Background(), child) //nolint:errcheck // also after a failure
	c, err := st.c.Runtime.Get(ctx, child)
	must(t, err)
	if !reflect.DeepEqual(c.Metadata, tags) || c.ForkedFrom != m.VMID {
		t.Fatalf("%+v", c)
	}
	vms, err := st.c.Runtime.List(ctx, WithMetadata("run", run))
	must(t, err)
	if ids := vmIDs(vms); !reflect.DeepEqual(ids, []string{m.VMID, child}) {
		t.Fatalf("%v", ids)
	}
	vms, err = st.c.Runtime.List(ctx, WithMetadata("run", run), WithMetadata("sdk", "nobody"))
	must(t, err)
	if len(vms) != 0 {
		t.Fatalf("%v", vmIDs(vms))
	}
	_, err = st.c.Runtime.Schedule(ctx, AgentSpec{Metadata: map[string]string{"bad key": "x"}})
	expectAPIError(t, err, ErrBadRequest, 400, "INVALID_ARGUMENT")
	for _, id := range []string{child, m.VMID} {
		del, err := st.c.Runtime.Delete(ctx, id)
		must(t, err)
		if del.State != "terminated" {
			t.Fatalf("%+v", del)
		}
	}
}

func scenarioLifetime(t *testing.T, ctx context.Context, st *contract) {
	vm, err := st.c.Runtime.Schedule(ctx, AgentSpec{LifetimeSecs: 3600, OnLifetimeEnd: "delete"})
	must(t, err)
	defer st.c.Runtime.Delete(context.Background(), vm.VMID) //nolint:errcheck // also after a failure
	if vm.LifetimeSecs == nil || *vm.LifetimeSecs != 3600 || vm.OnLifetimeEnd != "delete" || vm.LifetimeEndsAt == "" {
		t.Fatalf("%+v", vm)
	}
	ext, err := st.c.Runtime.ExtendLifetime(ctx, vm.VMID, 60)
	must(t, err)
	if ext.LifetimeSecs == nil || *ext.LifetimeSecs != 3660 {
		t.Fatalf("%+v", ext)
	}
	one := 1
	set, err := st.c.Runtime.SetLifetime(ctx, vm.VMID, LifetimeUpdate{LifetimeSecs: &one})
	must(t, err)
	if set.LifetimeSecs == nil || *set.LifetimeSecs != 1 {
		t.Fatalf("%+v", set)
	}
	// A hang guard, not a speed bound: the test server sweeps lifetimes every second.
	deadline := time.Now().Add(5 * time.Minute)
	for {
		got, err := st.c.Runtime.Get(ctx, vm.VMID)
		must(t, err)
		if got.State == "terminated" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("never terminated: %+v", got)
		}
		time.Sleep(250 * time.Millisecond)
	}
	events, err := st.c.Runtime.Events(ctx, vm.VMID)
	must(t, err)
	actions := []interface{}{}
	for _, e := range events {
		if e.Kind == "lifetime_ended" {
			actions = append(actions, e.Details["action"])
		}
	}
	if !reflect.DeepEqual(actions, []interface{}{"deleted"}) {
		t.Fatalf("%v", actions)
	}
}

func scenarioPagination(t *testing.T, ctx context.Context, st *contract) {
	page := unique(t)
	var ids []string
	for i := 0; i < 2; i++ {
		vm, err := st.c.Runtime.Schedule(ctx, AgentSpec{Metadata: map[string]string{"page": page}})
		must(t, err)
		ids = append(ids, vm.VMID)
		defer st.c.Runtime.Delete(context.Background(), vm.VMID) //nolint:errcheck // also after a failure
	}
	it := st.c.Runtime.IterVMs(WithMetadata("page", page), WithPageSize(1))
	seen := []string{}
	for it.Next(ctx) {
		seen = append(seen, it.Item().VMID)
	}
	must(t, it.Err())
	if !reflect.DeepEqual(seen, ids) {
		t.Fatalf("%v != %v", seen, ids)
	}
	paged, err := st.c.Runtime.IterEvents(ids[0], WithPageSize(1)).All(ctx)
	must(t, err)
	whole, err := st.c.Runtime.Events(ctx, ids[0])
	must(t, err)
	if len(paged) == 0 || !reflect.DeepEqual(paged, whole) {
		t.Fatalf("%v != %v", paged, whole)
	}
	pagedImages, err := st.c.Images.Iter(WithPageSize(1)).All(ctx)
	must(t, err)
	images, err := st.c.Images.List(ctx)
	must(t, err)
	if len(images) == 0 || !reflect.DeepEqual(pagedImages, images) {
		t.Fatalf("%v != %v", pagedImages, images)
	}
	pagedSnaps, err := st.c.Runtime.IterSnapshots(ids[0], WithPageSize(1)).All(ctx)
	must(t, err)
	snaps, err := st.c.Runtime.Snapshots(ctx, ids[0])
	must(t, err)
	if !reflect.DeepEqual(pagedSnaps, snaps) {
		t.Fatalf("%v != %v", pagedSnaps, snaps)
	}
	bad := call{route: routeListVMs, query: url.Values{"cursor": {"not-a-cursor"}}}
	expectAPIError(t, st.c.doJSON(ctx, bad, nil), ErrBadRequest, 400, "INVALID_ARGUMENT")
	for _, id := range ids {
		del, err := st.c.Runtime.Delete(ctx, id)
		must(t, err)
		if del.State != "terminated" {
			t.Fatalf("%+v", del)
		}
	}
}
