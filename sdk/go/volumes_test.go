package pal

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"testing"
)

// The volume calls' requests as the server receives them, and their answers decoded.
func TestVolumesCallsAndAnswers(t *testing.T) {
	var seen []string
	var body map[string]interface{}
	c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
		seen = append(seen, r.Method+" "+r.URL.RequestURI())
		body = nil
		if r.Body != nil {
			_ = json.NewDecoder(r.Body).Decode(&body)
		}
		if r.Method == "GET" && r.URL.Path == "/v1/volumes" {
			if r.URL.Query().Get("cursor") == "" {
				fmt.Fprint(w, `{"volumes":[{"volumeId":"vol-1","name":"a","sizeMib":8,"state":"ready"}],"nextCursor":"c1"}`)
			} else {
				fmt.Fprint(w, `{"volumes":[{"volumeId":"vol-2","name":"b","sizeMib":8,"state":"ready"}]}`)
			}
			return
		}
		fmt.Fprint(w, `{"volumeId":"vol-1","name":"a","sizeMib":16,"state":"ready","metadata":{"k":"v"},"mountedBy":["vm-1"]}`)
	})
	ctx := context.Background()
	v, err := c.Volumes.Create(ctx, VolumeSpec{Name: "a", SizeMib: 16, Metadata: map[string]string{"k": "v"}})
	if err != nil || v.VolumeID != "vol-1" || v.SizeMib != 16 || v.Metadata["k"] != "v" {
		t.Fatalf("create: %v %+v", err, v)
	}
	if body["name"] != "a" || body["sizeMib"] != float64(16) {
		t.Fatalf("create body %v", body)
	}
	all, err := c.Volumes.List(ctx, WithMetadata("k", "v"), WithPageSize(1))
	if err != nil || len(all) != 2 || all[1].VolumeID != "vol-2" {
		t.Fatalf("list: %v %+v", err, all)
	}
	if got, err := c.Volumes.Get(ctx, "a"); err != nil || len(got.MountedBy) != 1 {
		t.Fatalf("get: %v %+v", err, got)
	}
	if _, err := c.Volumes.Resize(ctx, "a", 32); err != nil || body["sizeMib"] != float64(32) {
		t.Fatalf("resize: %v %v", err, body)
	}
	if _, err := c.Volumes.Delete(ctx, "a", true); err != nil {
		t.Fatal(err)
	}
	want := []string{
		"POST /v1/volumes",
		"GET /v1/volumes?limit=1&metadata.k=v",
		"GET /v1/volumes?cursor=c1&limit=1&metadata.k=v",
		"GET /v1/volumes/a",
		"POST /v1/volumes/a/resize",
		"DELETE /v1/volumes/a?force=true",
	}
	if fmt.Sprint(seen) != fmt.Sprint(want) {
		t.Fatalf("requests\n got %v\nwant %v", seen, want)
	}
}

// The volume files calls' requests as the server receives them, and their answers decoded.
func TestVolumeFilesCallsAndAnswers(t *testing.T) {
	var seen []string
	var sent []byte
	c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
		seen = append(seen, r.Method+" "+r.URL.RequestURI())
		switch {
		case r.Method == "PUT":
			sent, _ = io.ReadAll(r.Body)
			fmt.Fprint(w, `{"path":"d/a.txt","bytesWritten":5}`)
		case r.URL.Path == "/v1/volumes/data/files/content" && r.Method == "GET":
			w.Header().Set("X-Pal-Truncated", "true")
			fmt.Fprint(w, "hello")
		case r.URL.Path == "/v1/volumes/data/files":
			fmt.Fprint(w, `{"path":"d","entries":[{"name":"l","type":"symlink","size":3,"path":"d/l","mode":511,"uid":1000,"gid":1000,"modifiedAt":"2026-12-07T00:00:00Z","target":"/etc"}],"truncated":false}`)
		case r.URL.Query().Get("path") == "nope":
			w.WriteHeader(404)
			fmt.Fprint(w, `{"error":{"code":"FILE_NOT_FOUND","message":"no such file"}}`)
		case r.URL.Path == "/v1/volumes/data/files/stat":
			fmt.Fprint(w, `{"name":"a.txt","type":"file","size":5,"path":"d/a.txt","mode":420,"uid":1000,"gid":1000,"modifiedAt":"2026-12-07T00:00:00Z"}`)
		case r.Method == "POST":
			fmt.Fprint(w, `{"path":"d/e","created":true}`)
		default:
			fmt.Fprint(w, `{"path":"d","deleted":true}`)
		}
	})
	ctx := context.Background()
	if w, err := c.Volumes.WriteFile(ctx, "data", "d/a.txt", []byte("hello")); err != nil || w.BytesWritten != 5 || string(sent) != "hello" {
		t.Fatalf("write: %v %+v %q", err, w, sent)
	}
	if got, err := c.Volumes.ReadFile(ctx, "data", "d/a.txt"); err != ErrTruncated || string(got) != "hello" {
		t.Fatalf("read: %v %q", err, got)
	}
	l, err := c.Volumes.ListFiles(ctx, "data", "d", 2)
	if err != nil || len(l.Entries) != 1 || *l.Entries[0].Target != "/etc" || l.Entries[0].Mode != 0o777 {
		t.Fatalf("list: %v %+v", err, l)
	}
	if st, err := c.Volumes.Stat(ctx, "data", "d/a.txt"); err != nil || st.Size != 5 || st.Target != nil {
		t.Fatalf("stat: %v %+v", err, st)
	}
	if ok, err := c.Volumes.Exists(ctx, "data", "nope"); ok || err != nil {
		t.Fatalf("exists: %v %v", ok, err)
	}
	if ok, err := c.Volumes.Exists(ctx, "data", "d/a.txt"); !ok || err != nil {
		t.Fatalf("exists: %v %v", ok, err)
	}
	if d, err := c.Volumes.MakeDir(ctx, "data", "d/e", true); err != nil || !d.Created {
		t.Fatalf("mkdir: %v %+v", err, d)
	}
	if d, err := c.Volumes.DeleteFile(ctx, "data", "d", true); err != nil || !d.Deleted {
		t.Fatalf("delete: %v %+v", err, d)
	}
	want := []string{
		"PUT /v1/volumes/data/files/content?path=d%2Fa.txt",
		"GET /v1/volumes/data/files/content?path=d%2Fa.txt",
		"GET /v1/volumes/data/files?depth=2&path=d",
		"GET /v1/volumes/data/files/stat?path=d%2Fa.txt",
		"GET /v1/volumes/data/files/stat?path=nope",
		"GET /v1/volumes/data/files/stat?path=d%2Fa.txt",
		"POST /v1/volumes/data/files/dir?parents=true&path=d%2Fe",
		"DELETE /v1/volumes/data/files/content?path=d&recursive=true",
	}
	if fmt.Sprint(seen) != fmt.Sprint(want) {
		t.Fatalf("requests\n got %v\nwant %v", seen, want)
	}
}
