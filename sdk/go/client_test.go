package pal

// Unit tests against an httptest server (no Pal server, no network): configuration,
// errors, retries, the event stream and files. contract_test.go runs the shared scenarios
// against a real server.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

func fakeServer(t *testing.T, h http.HandlerFunc) *Client {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return NewClient(WithURL(srv.URL+"/"), WithAPIKey("pal_test"), WithRetries(2))
}

func TestNewClientReadsTheEnvironment(t *testing.T) {
	t.Setenv("PAL_URL", "http://example.invalid:9/")
	t.Setenv("PAL_API_KEY", "pal_env")
	c := NewClient()
	if c.URL() != "http://example.invalid:9" || c.apiKey != "pal_env" {
		t.Fatalf("url %q key %q", c.URL(), c.apiKey)
	}
	c = NewClient(WithURL("http://other:1"), WithAPIKey("pal_opt"))
	if c.URL() != "http://other:1" || c.apiKey != "pal_opt" {
		t.Fatalf("options must win over the environment: %q %q", c.URL(), c.apiKey)
	}
	t.Setenv("PAL_URL", "")
	if NewClient().URL() != DefaultURL {
		t.Fatal("default URL")
	}
}

func TestRequestsCarryKeyUserAgentAndEscapedIDs(t *testing.T) {
	var got *http.Request
	c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
		got = r
		fmt.Fprint(w, `{"vmId":"a/b","state":"running","image":"default","limits":{},"createdAt":"x"}`)
	})
	vm, err := c.Runtime.Get(context.Background(), "a/b")
	if err != nil || vm.VMID != "a/b" || vm.State != "running" {
		t.Fatalf("%v %+v", err, vm)
	}
	if got.Header.Get("Authorization") != "Bearer pal_test" || !strings.HasPrefix(got.Header.Get("User-Agent"), "pal-go/") {
		t.Fatalf("headers %v", got.Header)
	}
	if got.URL.EscapedPath() != "/v1/runtime/vms/a%2Fb" {
		t.Fatalf("path %q", got.URL.EscapedPath())
	}
	// Text pasted into an id stays in its one segment: the server refuses it as an id.
	if _, err := c.Runtime.Get(context.Background(), "a/resume?x=#y"); err != nil {
		t.Fatalf("get: %v", err)
	}
	if got.URL.EscapedPath() != "/v1/runtime/vms/a%2Fresume%3Fx=%23y" || got.URL.RawQuery != "" {
		t.Fatalf("path %q query %q", got.URL.EscapedPath(), got.URL.RawQuery)
	}
	if _, err := c.Runtime.Get(context.Background(), ""); !errors.Is(err, ErrBadRequest) {
		t.Fatalf("an empty id must be refused before any request: %v", err)
	}
}

func TestErrorsMatchTheirSentinels(t *testing.T) {
	cases := map[int]error{400: ErrBadRequest, 401: ErrUnauthorized, 402: ErrQuota, 403: ErrForbidden,
		404: ErrNotFound, 409: ErrConflict, 413: ErrTooLarge, 503: ErrUnavailable, 504: ErrGuestTimeout}
	for status, sentinel := range cases {
		c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(status)
			fmt.Fprintf(w, `{"error":{"code":"C%d","message":"m","requestId":"rid"}}`, status)
		})
		c.retries = 0
		_, err := c.Runtime.ResumeVM(context.Background(), "vm")
		var apiErr *APIError
		if !errors.Is(err, sentinel) || !errors.As(err, &apiErr) {
			t.Fatalf("%d: %v", status, err)
		}
		if apiErr.Status != status || apiErr.Code != fmt.Sprintf("C%d", status) || apiErr.Message != "m" || apiErr.RequestID != "rid" {
			t.Fatalf("%+v", apiErr)
		}
		if errors.Is(err, ErrServer) != (status >= 500) || (status != 404 && errors.Is(err, ErrNotFound)) {
			t.Fatalf("%d matches the wrong sentinels", status)
		}
	}
	c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Request-Id", "hdr")
		w.WriteHeader(502)
		fmt.Fprint(w, "<html>bad gateway</html>")
	})
	c.retries = 0
	var apiErr *APIError
	if _, err := c.Runtime.Delete(context.Background(), "vm"); !errors.As(err, &apiErr) || apiErr.Code != "HTTP_ERROR" ||
		apiErr.RequestID != "hdr" || !strings.Contains(apiErr.Message, "bad gateway") || !errors.Is(err, ErrServer) {
		t.Fatalf("%v", err)
	}
}

func TestGetsAreRetriedOtherCallsAreNot(t *testing.T) {
	var gets, posts int32
	c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
		n := &posts
		if r.Method == http.MethodGet {
			n = &gets
		}
		if atomic.AddInt32(n, 1) < 3 {
			w.WriteHeader(503)
			fmt.Fprint(w, `{"error":{"code":"UNAVAILABLE","message":"busy"}}`)
			return
		}
		fmt.Fprint(w, `{"vms":[]}`)
	})
	if _, err := c.Runtime.List(context.Background()); err != nil || gets != 3 {
		t.Fatalf("a GET is retried on 503: %v after %d tries", err, gets)
	}
	if _, err := c.Runtime.PauseVM(context.Background(), "vm"); !errors.Is(err, ErrUnavailable) || posts != 1 {
		t.Fatalf("a POST that reached the server is never retried: %v after %d tries", err, posts)
	}
}

func TestCallsAreRetriedWhenTheConnectionCouldNotBeMade(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens: every dial is refused
	c := NewClient(WithURL("http://"+addr), WithRetries(1))
	_, err = c.Runtime.ForkVM(context.Background(), "vm", 1)
	var connErr *ConnectionError
	if !errors.Is(err, ErrConnection) || !errors.As(err, &connErr) || !retryable("POST", err) {
		t.Fatalf("a refused connection sent nothing, so even a POST may retry: %v", err)
	}
	if retryable("POST", &ConnectionError{Err: io.ErrUnexpectedEOF}) || !retryable("GET", &ConnectionError{Err: io.ErrUnexpectedEOF}) {
		t.Fatal("a connection broken after sending: only a GET retries")
	}
}

func sseServer(t *testing.T, body string, hold chan struct{}) *Client {
	return fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Accept") != "text/event-stream" {
			t.Errorf("accept %q", r.Header.Get("Accept"))
		}
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, body)
		w.(http.Flusher).Flush()
		if hold != nil {
			select {
			case <-hold:
			case <-r.Context().Done():
				close(hold)
			}
		}
	})
}

func TestExecStreamYieldsEventsInOrder(t *testing.T) {
	body := ": keepalive\n\nevent: stdout\ndata: {\"data\":\"a\\n\"}\n\nevent: future\ndata: {}\n\n" +
		"event: stderr\r\ndata: {\"data\":\"b\"}\r\n\r\nevent: exit\ndata: {\"exitCode\":3,\"timedOut\":true}\n\n"
	c := sseServer(t, body, nil)
	s, err := c.Runtime.ExecStream(context.Background(), "vm", ExecRequest{Command: "/bin/true"})
	if err != nil {
		t.Fatal(err)
	}
	var got []ExecEvent
	for s.Next() {
		got = append(got, s.Event())
	}
	want := []ExecEvent{{Type: "stdout", Data: "a\n"}, {Type: "stderr", Data: "b"}, {Type: "exit", ExitCode: 3, TimedOut: true}}
	if s.Err() != nil || fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("%v %v", s.Err(), got)
	}
}

func TestExecStreamErrorEventAndEarlyEnd(t *testing.T) {
	c := sseServer(t, "event: error\ndata: {\"code\":\"GUEST_GONE\",\"message\":\"m\"}\n\n", nil)
	s, _ := c.Runtime.ExecStream(context.Background(), "vm", ExecRequest{Command: "x"})
	if !s.Next() || s.Event().Type != EventError || s.Event().Data != "GUEST_GONE: m\n" || s.Next() || s.Err() != nil {
		t.Fatalf("%+v %v", s.Event(), s.Err())
	}
	c = sseServer(t, "event: stdout\ndata: {\"data\":\"x\"}\n\n", nil)
	s, _ = c.Runtime.ExecStream(context.Background(), "vm", ExecRequest{Command: "x"})
	if !s.Next() || s.Next() || !errors.Is(s.Err(), ErrStreamEnded) {
		t.Fatalf("a stream cut before exit must say so: %v", s.Err())
	}
}

func TestCancellingTheContextClosesTheStream(t *testing.T) {
	hold := make(chan struct{})
	c := sseServer(t, "event: stdout\ndata: {\"data\":\"ready\"}\n\n", hold)
	ctx, cancel := context.WithCancel(context.Background())
	s, err := c.Runtime.ExecStream(ctx, "vm", ExecRequest{Command: "x"})
	if err != nil || !s.Next() || s.Event().Data != "ready" {
		t.Fatalf("%v", err)
	}
	cancel()
	if s.Next() || !errors.Is(s.Err(), context.Canceled) {
		t.Fatalf("after cancel: %v", s.Err())
	}
	<-hold // the server saw its request end: the connection is closed
}

func TestCloseEndsTheStreamWithoutAnError(t *testing.T) {
	hold := make(chan struct{})
	c := sseServer(t, "event: stdout\ndata: {\"data\":\"ready\"}\n\n", hold)
	s, _ := c.Runtime.ExecStream(context.Background(), "vm", ExecRequest{Command: "x"})
	s.Next()
	go s.Close() // from another goroutine, while Next may be blocked reading
	if s.Next() || s.Err() != nil {
		t.Fatalf("Close is not an error: %v", s.Err())
	}
	<-hold
}

func TestFilesAreBytes(t *testing.T) {
	data := make([]byte, 256)
	for i := range data {
		data[i] = byte(i)
	}
	var stored []byte
	c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("path") != "d/b in.dat" {
			t.Errorf("query %q", r.URL.RawQuery)
		}
		switch r.Method {
		case http.MethodPut:
			if r.Header.Get("Content-Type") != "application/octet-stream" {
				t.Errorf("content type %q", r.Header.Get("Content-Type"))
			}
			stored, _ = io.ReadAll(r.Body)
			fmt.Fprintf(w, `{"path":"d/b in.dat","bytesWritten":%d}`, len(stored))
		case http.MethodGet:
			w.Header().Set("X-Pal-Truncated", "true")
			w.Write(stored)
		}
	})
	ctx := context.Background()
	if w, err := c.Runtime.WriteFile(ctx, "vm", "d/b in.dat", data); err != nil || w.BytesWritten != 256 {
		t.Fatalf("%v %+v", err, w)
	}
	got, err := c.Runtime.ReadFile(ctx, "vm", "d/b in.dat")
	if !errors.Is(err, ErrTruncated) || string(got) != string(data) {
		t.Fatalf("a truncated read returns its bytes and ErrTruncated: %v", err)
	}
}

func TestEgressAndSecretsMarshalAsTheAPITakesThem(t *testing.T) {
	var body string
	c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		body = string(b)
		fmt.Fprint(w, `{"vmId":"v","state":"running","image":"i","limits":{},"createdAt":"x","egress":{"allow":["a.com"]}}`)
	})
	spec := AgentSpec{Egress: EgressNone(), Secrets: map[string]Secret{
		"A": {Value: "1"}, "B": {Value: "2", Brokered: &Brokering{Hosts: []string{"h"}}}}}
	vm, err := c.Runtime.Schedule(context.Background(), spec)
	if err != nil || vm.Egress == nil || fmt.Sprint(vm.Egress.Allow) != "[a.com]" {
		t.Fatalf("%v %+v", err, vm)
	}
	want := `{"egress":"none","secrets":{"A":"1","B":{"value":"2","brokered":{"hosts":["h"]}}}}`
	if body != want {
		t.Fatalf("body %s", body)
	}
	if _, err := c.Runtime.SetEgress(context.Background(), "v", &Egress{Mode: "open", Allow: []string{"x"}}); err == nil {
		t.Fatal("an Egress with a mode and rules is refused")
	}
}

func TestPortLinksAreSignedAndRevoked(t *testing.T) {
	var calls []string
	c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		calls = append(calls, r.Method+" "+r.URL.EscapedPath()+" "+string(b))
		if r.Method == http.MethodPost {
			fmt.Fprint(w, `{"url":"http://p/","expiresAt":9,"linkId":"lnk_1"}`)
			return
		}
		fmt.Fprint(w, `{"linkId":"lnk_1","revoked":true}`)
	})
	ctx := context.Background()
	link, err := c.Runtime.PortURL(ctx, "vm", 8080, 90*time.Second)
	if err != nil || link.LinkID != "lnk_1" || link.ExpiresAt != 9 {
		t.Fatalf("%v %+v", err, link)
	}
	rev, err := c.Runtime.RevokePortURL(ctx, "vm", link.LinkID)
	if err != nil || !rev.Revoked {
		t.Fatalf("%v %+v", err, rev)
	}
	want := []string{`POST /v1/runtime/vms/vm/ports/8080/url {"expiresInSecs":90}`, "DELETE /v1/runtime/vms/vm/port-links/lnk_1 "}
	if fmt.Sprint(calls) != fmt.Sprint(want) {
		t.Fatalf("%q", calls)
	}
}

func TestStartFromSnapshotAndForkSendTagsAndSecretsOnlyWhenGiven(t *testing.T) {
	var bodies []string
	c := fakeServer(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		bodies = append(bodies, r.Method+" "+r.URL.EscapedPath()+" "+string(b))
		fmt.Fprint(w, `{"sourceVmId":"vm-s","snapshotId":"snap-1","forks":[{"vmId":"vm-c","state":"running"}]}`)
	})
	ctx := context.Background()
	res, err := c.Runtime.StartFromSnapshot(ctx, "golden", 1)
	if err != nil || len(res.Forks) != 1 || res.Forks[0].VMID != "vm-c" {
		t.Fatalf("%v %+v", err, res)
	}
	if _, err := c.Runtime.StartFromSnapshotTagged(ctx, "golden", 2, map[string]string{"run": "7"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Runtime.StartFromSnapshotTagged(ctx, "golden", 1, nil); err != nil {
		t.Fatal(err)
	}
	secret := map[string]Secret{"A": {Value: "1"}}
	if _, err := c.Runtime.StartFromSnapshotWith(ctx, "golden", 1, ChildOptions{Secrets: secret}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Runtime.ForkVMWith(ctx, "vm-s", 1, ChildOptions{Metadata: map[string]string{"k": "v"}, Secrets: secret}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Runtime.ForkVM(ctx, "vm-s", 2); err != nil {
		t.Fatal(err)
	}
	want := []string{
		`POST /v1/runtime/snapshots/golden/start {"count":1}`,
		`POST /v1/runtime/snapshots/golden/start {"count":2,"metadata":{"run":"7"}}`,
		`POST /v1/runtime/snapshots/golden/start {"count":1,"metadata":{}}`,
		`POST /v1/runtime/snapshots/golden/start {"count":1,"secrets":{"A":"1"}}`,
		`POST /v1/runtime/vms/vm-s/fork {"count":1,"metadata":{"k":"v"},"secrets":{"A":"1"}}`,
		`POST /v1/runtime/vms/vm-s/fork {"count":2}`,
	}
	if fmt.Sprint(bodies) != fmt.Sprint(want) {
		t.Fatalf("%q", bodies)
	}
}
