package pal

// The contract's volumes scenario (see contract_test.go): a volume and its files, no VM.

import (
	"bytes"
	"context"
	"errors"
	"testing"
)

func scenarioVolumes(t *testing.T, ctx context.Context, st *contract) {
	name := "c-" + unique(t)
	v, err := st.c.Volumes.Create(ctx, VolumeSpec{Name: name, SizeMib: 8})
	must(t, err)
	if v.State != "ready" || v.SizeMib != 8 {
		t.Fatalf("%+v", v)
	}
	defer func() {
		gone, err := st.c.Volumes.Delete(ctx, v.VolumeID, false)
		must(t, err)
		if gone.State != "deleted" {
			t.Fatalf("%+v", gone)
		}
		_, err = st.c.Volumes.Get(ctx, v.VolumeID)
		var apiErr *APIError
		if !errors.Is(err, ErrNotFound) || !errors.As(err, &apiErr) || apiErr.Code != "NOT_FOUND" {
			t.Fatalf("get after delete: %v", err)
		}
	}()
	data := []byte{0, 255, 1, 2}
	w, err := st.c.Volumes.WriteFile(ctx, name, "dir/a.bin", data)
	must(t, err)
	if w.Path != "dir/a.bin" || w.BytesWritten != 4 {
		t.Fatalf("%+v", w)
	}
	got, err := st.c.Volumes.ReadFile(ctx, name, "dir/a.bin")
	must(t, err)
	if !bytes.Equal(got, data) {
		t.Fatalf("read %v", got)
	}
	l, err := st.c.Volumes.ListFiles(ctx, name, "", 2)
	must(t, err)
	if len(l.Entries) != 2 || l.Entries[0].Path != "dir" || l.Entries[0].Type != "dir" ||
		l.Entries[1].Path != "dir/a.bin" || l.Entries[1].Type != "file" {
		t.Fatalf("%+v", l.Entries)
	}
	s, err := st.c.Volumes.Stat(ctx, name, "dir/a.bin")
	must(t, err)
	if s.Size != 4 {
		t.Fatalf("%+v", s)
	}
	if ok, err := st.c.Volumes.Exists(ctx, name, "nope"); ok || err != nil {
		t.Fatalf("exists: %v %v", ok, err)
	}
	_, err = st.c.Volumes.ReadFile(ctx, name, "../escape")
	var apiErr *APIError
	if !errors.Is(err, ErrBadRequest) || !errors.As(err, &apiErr) || apiErr.Code != "PATH_ESCAPE" {
		t.Fatalf("escape: %v", err)
	}
	d, err := st.c.Volumes.DeleteFile(ctx, name, "dir", true)
	must(t, err)
	if !d.Deleted {
		t.Fatalf("%+v", d)
	}
}
