package pal

// Unit tests of the process calls against an httptest server: the output stream reattaches
// from its last offset after a detached event and after a dropped connection, and stops on
// a final error; stdin is resent from what the server took.

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
)

func b64(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }

func TestOutputStreamReattachesFromItsOffset(t *testing.T) {
	var mu sync.Mutex
	var froms []string
	attach := 0
	c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		froms = append(froms, r.URL.Query().Get("from"))
		attach++
		n := attach
		mu.Unlock()
		if r.URL.Path != "/v1/runtime/vms/vm-1/processes/7/output" || r.Header.Get("Accept") != "text/event-stream" {
			t.Errorf("request %s %v", r.URL, r.Header)
		}
		w.Header().Set("Content-Type", "text/event-stream")
		switch n {
		case 1: // two events, then the VM pauses
			fmt.Fprintf(w, "id: 3\nevent: stdout\ndata: {\"data\":%q}\n\n", b64("abc"))
			fmt.Fprintf(w, "id: 5\nevent: stderr\ndata: {\"data\":%q}\n\n", b64("de"))
			fmt.Fprint(w, "event: detached\ndata: {\"reason\":\"vm-stopped\"}\n\n")
		case 2: // the connection drops mid-stream
			fmt.Fprintf(w, "id: 6\nevent: stdout\ndata: {\"data\":%q}\n\n", b64("f"))
			w.(http.Flusher).Flush()
			hj, _, _ := w.(http.Hijacker).Hijack()
			hj.Close()
		case 3: // the VM is paused by an operator: 409 until it is resumed
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(409)
			fmt.Fprint(w, `{"error":{"code":"FAILED_PRECONDITION","message":"paused","requestId":"r"}}`)
		default:
			fmt.Fprint(w, "id: 10\nevent: gap\ndata: {\"lost\":4}\n\n")
			fmt.Fprint(w, "event: exit\ndata: {\"exitCode\":2,\"timedOut\":false}\n\n")
		}
	})
	out, err := c.Runtime.Processes.Output(context.Background(), "vm-1", 7, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	var got []string
	for out.Next() {
		ev := out.Event()
		got = append(got, fmt.Sprintf("%s:%s:%d:%d:%d", ev.Type, ev.Data, ev.Offset, ev.Lost, ev.ExitCode))
	}
	if out.Err() != nil {
		t.Fatal(out.Err())
	}
	want := []string{"stdout:abc:3:0:0", "stderr:de:5:0:0", "stdout:f:6:0:0", "gap::10:4:0", "exit::0:0:2"}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("events %v, want %v", got, want)
	}
	if strings.Join(froms, ",") != "0,5,6,6" {
		t.Fatalf("attached from %v, want 0,5,6,6", froms)
	}
}

func TestOutputStreamStopsOnAFinalError(t *testing.T) {
	c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "event: error\ndata: {\"code\":\"GUEST_ERROR\",\"message\":\"boom\"}\n\n")
	})
	out, err := c.Runtime.Processes.Output(context.Background(), "vm-1", 7, 0)
	if err != nil {
		t.Fatal(err)
	}
	if out.Next() {
		t.Fatalf("an event after an error: %+v", out.Event())
	}
	var apiErr *APIError
	if !errors.As(out.Err(), &apiErr) || apiErr.Code != "STREAM_ERROR" || !strings.Contains(apiErr.Message, "boom") {
		t.Fatalf("Err() %v", out.Err())
	}
	_, err = fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(404)
		fmt.Fprint(w, `{"error":{"code":"PROCESS_NOT_FOUND","message":"no","requestId":"r"}}`)
	}).Runtime.Processes.Output(context.Background(), "vm-1", 8, 0)
	if !errors.Is(err, ErrNotFound) {
		t.Fatalf("an unknown process: %v", err)
	}
}

func TestSendStdinResendsWhatTheServerDidNotTake(t *testing.T) {
	var got []string
	c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		got = append(got, string(body))
		n := len(body)
		if n > 2 {
			n = 2 // a slow reader: takes two bytes a call
		}
		fmt.Fprintf(w, `{"written":%d,"closed":false}`, n)
	})
	if err := c.Runtime.Processes.SendStdin(context.Background(), "vm-1", 3, []byte("hello")); err != nil {
		t.Fatal(err)
	}
	if strings.Join(got, "|") != "hello|llo|o" {
		t.Fatalf("sent %q", got)
	}
}
