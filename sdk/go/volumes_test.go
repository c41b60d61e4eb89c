package pal

import (
	"context"
	"encoding/json"
	"fmt"
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
