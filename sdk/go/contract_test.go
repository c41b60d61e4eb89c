package pal

// The shared SDK contract (../contract/scenarios.json) against a real Pal server. It runs
// when PAL_CONTRACT=1, with PAL_URL and PAL_API_KEY naming the server and a tenant with
// room for the file's tenantMaxVms VMs; tests/e2e/test_sdk_contract.py starts a server and
// runs it. Each scenario is a subtest named by its id, run in the file's order.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"strings"
	"testing"
	"time"
)

type scenarioFile struct {
	TenantMaxVms int `json:"tenantMaxVms"`
	Scenarios    []struct {
		ID     string `json:"id"`
		Status string `json:"status"`
		Note   string `json:"note"`
	} `json:"scenarios"`
}

// contract is the state the scenarios share: the client and the VM "schedule" made.
type contract struct {
	c   *Client
	vm  string
	max int
}

var contractScenarios = map[string]func(*testing.T, context.Context, *contract){
	"schedule":          scenarioSchedule,
	"exec-buffered":     scenarioExecBuffered,
	"exec-stream":       scenarioExecStream,
	"exec-stream-close": scenarioExecStreamClose,
	"files-bytes":       scenarioFilesBytes,
	"pause-resume":      scenarioPauseResume,
	"fork":              scenarioFork,
	"errors":            scenarioErrors,
	"delete":            scenarioDelete,
	"processes":         scenarioProcesses,
	"metadata":          scenarioMetadata,   // contract_meta_test.go
	"lifetime":          scenarioLifetime,   // contract_meta_test.go
	"pagination":        scenarioPagination, // contract_meta_test.go
	"volumes":           scenarioVolumes,    // contract_volumes_test.go
}

func TestContract(t *testing.T) {
	if os.Getenv("PAL_CONTRACT") != "1" {
		t.Skip("set PAL_CONTRACT=1, PAL_URL and PAL_API_KEY to run the SDK contract against a server")
	}
	raw, err := os.ReadFile("../contract/scenarios.json")
	if err != nil {
		t.Fatal(err)
	}
	var file scenarioFile
	if err := json.Unmarshal(raw, &file); err != nil {
		t.Fatal(err)
	}
	st := &contract{c: NewClient(), max: file.TenantMaxVms}
	seen := map[string]bool{}
	for _, sc := range file.Scenarios {
		sc := sc
		seen[sc.ID] = true
		t.Run(sc.ID, func(t *testing.T) {
			if sc.Status == "todo" {
				t.Skip(sc.Note)
			}
			run, ok := contractScenarios[sc.ID]
			if !ok {
				t.Fatalf("scenario %q has no Go implementation", sc.ID)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer cancel()
			run(t, ctx, st)
		})
	}
	for id := range contractScenarios {
		if !seen[id] {
			t.Errorf("the Go runner implements %q, which scenarios.json does not list", id)
		}
	}
	if st.vm != "" {
		st.c.Runtime.Delete(context.Background(), st.vm) //nolint:errcheck // cleanup after a failure
	}
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func needVM(t *testing.T, st *contract) {
	t.Helper()
	if st.vm == "" {
		t.Fatal("no VM: the schedule scenario failed")
	}
}

func shell(line string) ExecRequest {
	return ExecRequest{Command: "/bin/sh", Argv: []string{"-c", line}}
}

func scenarioSchedule(t *testing.T, ctx context.Context, st *contract) {
	vm, err := st.c.Runtime.Schedule(ctx, AgentSpec{})
	must(t, err)
	if vm.VMID == "" || vm.State != "running" {
		t.Fatalf("%+v", vm)
	}
	st.vm = vm.VMID
	got, err := st.c.Runtime.Get(ctx, st.vm)
	must(t, err)
	if got.VMID != st.vm || got.State != "running" {
		t.Fatalf("%+v", got)
	}
	vms, err := st.c.Runtime.List(ctx)
	must(t, err)
	for _, v := range vms {
		if v.VMID == st.vm {
			return
		}
	}
	t.Fatalf("%s not in the list", st.vm)
}

func scenarioExecBuffered(t *testing.T, ctx context.Context, st *contract) {
	needVM(t, st)
	res, err := st.c.Runtime.Exec(ctx, st.vm, shell("echo out; echo err >&2; exit 3"))
	must(t, err)
	if res.ExitCode != 3 || res.Stdout != "out\n" || res.Stderr != "err\n" {
		t.Fatalf("%+v", res)
	}
}

func scenarioExecStream(t *testing.T, ctx context.Context, st *contract) {
	needVM(t, st)
	s, err := st.c.Runtime.ExecStream(ctx, st.vm, shell("echo one; echo two >&2; exit 5"))
	must(t, err)
	defer s.Close()
	var out, errs strings.Builder
	var events []ExecEvent
	for s.Next() {
		ev := s.Event()
		events = append(events, ev)
		switch ev.Type {
		case EventStdout:
			out.WriteString(ev.Data)
		case EventStderr:
			errs.WriteString(ev.Data)
		}
	}
	must(t, s.Err())
	exits := 0
	for _, ev := range events {
		if ev.Type == EventExit {
			exits++
		}
	}
	last := events[len(events)-1]
	if out.String() != "one\n" || errs.String() != "two\n" || exits != 1 || last.Type != EventExit || last.ExitCode != 5 {
		t.Fatalf("%+v", events)
	}
}

func scenarioExecStreamClose(t *testing.T, ctx context.Context, st *contract) {
	needVM(t, st)
	sctx, cancel := context.WithCancel(ctx)
	s, err := st.c.Runtime.ExecStream(sctx, st.vm, shell("echo ready; exec sleep 600"))
	must(t, err)
	if !s.Next() || s.Event().Type != EventStdout || s.Event().Data != "ready\n" {
		cancel()
		t.Fatalf("first event %+v, %v", s.Event(), s.Err())
	}
	cancel()
	for s.Next() {
		if s.Event().Type == EventExit {
			t.Fatalf("a cancelled stream has no exit event: %+v", s.Event())
		}
	}
	if !errors.Is(s.Err(), context.Canceled) {
		t.Fatalf("Err() after cancel: %v", s.Err())
	}
	res, err := st.c.Runtime.Exec(ctx, st.vm, shell("echo again"))
	must(t, err)
	if res.ExitCode != 0 || res.Stdout != "again\n" {
		t.Fatalf("%+v", res)
	}
}

func scenarioFilesBytes(t *testing.T, ctx context.Context, st *contract) {
	needVM(t, st)
	data := make([]byte, 256)
	for i := range data {
		data[i] = byte(i)
	}
	w, err := st.c.Runtime.WriteFile(ctx, st.vm, "contract/bin.dat", data)
	must(t, err)
	if w.BytesWritten != 256 {
		t.Fatalf("%+v", w)
	}
	got, err := st.c.Runtime.ReadFile(ctx, st.vm, "contract/bin.dat")
	must(t, err)
	if !bytes.Equal(got, data) {
		t.Fatalf("read back %v", got)
	}
	list, err := st.c.Runtime.ListFiles(ctx, st.vm, "contract")
	must(t, err)
	found := false
	for _, e := range list.Entries {
		found = found || (e.Name == "bin.dat" && e.Type == "file" && e.Size != nil && *e.Size == 256)
	}
	if !found {
		t.Fatalf("%+v", list)
	}
	d, err := st.c.Runtime.DeleteFile(ctx, st.vm, "contract/bin.dat")
	must(t, err)
	if !d.Deleted {
		t.Fatalf("%+v", d)
	}
	_, err = st.c.Runtime.ReadFile(ctx, st.vm, "contract/bin.dat")
	expectAPIError(t, err, ErrNotFound, 404, "FILE_NOT_FOUND")
}

func scenarioPauseResume(t *testing.T, ctx context.Context, st *contract) {
	needVM(t, st)
	_, err := st.c.Runtime.WriteFile(ctx, st.vm, "keep.txt", []byte("kept"))
	must(t, err)
	p, err := st.c.Runtime.PauseVM(ctx, st.vm)
	must(t, err)
	if p.State != "paused" || p.SnapshotID == "" {
		t.Fatalf("%+v", p)
	}
	vm, err := st.c.Runtime.Get(ctx, st.vm)
	must(t, err)
	if vm.State != "paused" {
		t.Fatalf("%+v", vm)
	}
	_, err = st.c.Runtime.Exec(ctx, st.vm, ExecRequest{Command: "/bin/true"})
	expectAPIError(t, err, ErrConflict, 409, "FAILED_PRECONDITION")
	r, err := st.c.Runtime.ResumeVM(ctx, st.vm)
	must(t, err)
	if r.VMID != st.vm || r.State != "running" {
		t.Fatalf("%+v", r)
	}
	got, err := st.c.Runtime.ReadFile(ctx, st.vm, "keep.txt")
	must(t, err)
	if string(got) != "kept" {
		t.Fatalf("%q", got)
	}
}

func scenarioFork(t *testing.T, ctx context.Context, st *contract) {
	needVM(t, st)
	res, err := st.c.Runtime.ForkVM(ctx, st.vm, 1)
	must(t, err)
	if res.SourceVMID != st.vm || len(res.Forks) != 1 {
		t.Fatalf("%+v", res)
	}
	child := res.Forks[0]
	defer st.c.Runtime.Delete(context.Background(), child.VMID) //nolint:errcheck // also after a failure
	if child.State != "running" || child.Error != "" || child.VMID == "" || child.VMID == st.vm {
		t.Fatalf("%+v", child)
	}
	got, err := st.c.Runtime.ReadFile(ctx, child.VMID, "keep.txt")
	must(t, err)
	vm, err := st.c.Runtime.Get(ctx, child.VMID)
	must(t, err)
	if string(got) != "kept" || vm.ParentVMID != st.vm {
		t.Fatalf("%q %+v", got, vm)
	}
	del, err := st.c.Runtime.Delete(ctx, child.VMID)
	must(t, err)
	if del.State != "terminated" {
		t.Fatalf("%+v", del)
	}
}

func scenarioErrors(t *testing.T, ctx context.Context, st *contract) {
	needVM(t, st)
	_, err := st.c.Runtime.Get(ctx, "vm-does-not-exist")
	expectAPIError(t, err, ErrNotFound, 404, "NOT_FOUND")
	_, err = NewClient(WithAPIKey("pal_not_a_key")).Runtime.List(ctx)
	expectAPIError(t, err, ErrUnauthorized, 401, "UNAUTHENTICATED")
	_, err = st.c.Runtime.ReadFile(ctx, st.vm, "../etc/passwd")
	expectAPIError(t, err, ErrBadRequest, 400, "PATH_ESCAPE")
	_, err = st.c.Runtime.WriteFile(ctx, st.vm, "big.bin", make([]byte, 1<<20+1))
	expectAPIError(t, err, ErrTooLarge, 413, "PAYLOAD_TOO_LARGE")
	_, err = st.c.Runtime.ResumeVM(ctx, st.vm)
	expectAPIError(t, err, ErrConflict, 409, "FAILED_PRECONDITION")
	_, err = st.c.Runtime.ForkVM(ctx, st.vm, 50)
	expectAPIError(t, err, ErrQuota, 402, "QUOTA_EXCEEDED")
}

func scenarioDelete(t *testing.T, ctx context.Context, st *contract) {
	needVM(t, st)
	vm, err := st.c.Runtime.Delete(ctx, st.vm)
	must(t, err)
	if vm.State != "terminated" {
		t.Fatalf("%+v", vm)
	}
	st.vm = ""
}

func expectAPIError(t *testing.T, err error, sentinel error, status int, code string) {
	t.Helper()
	var apiErr *APIError
	if !errors.Is(err, sentinel) || !errors.As(err, &apiErr) {
		t.Fatalf("want %v, got %v", sentinel, err)
	}
	if apiErr.Status != status || apiErr.Code != code || apiErr.Message == "" || apiErr.RequestID == "" {
		t.Fatalf("want %d %s with a message and request id, got %+v", status, code, apiErr)
	}
}
