package pal

// The contract's "processes" scenario (../contract/scenarios.json), on a VM of its own.

import (
	"context"
	"strconv"
	"strings"
	"testing"
)

const (
	contractPScript = `echo ready; while IFS= read -r l; do echo "got:$l"; done; echo eof; exit 3`
	contractQScript = `trap "echo caught; exit 42" INT; echo armed; while :; do sleep 1; done`
	contractRScript = `i=0; while :; do i=$((i+1)); echo tick $i; [ -e /tmp/stop ] && exit 0; sleep 0.2; done`
)

// followOutput reads a stream to its end: stdout joined, and the exit event. onText sees the
// stdout so far after each event. It checks each stdout offset follows its bytes from base,
// and that one exit event comes last.
func followOutput(t *testing.T, out *OutputStream, base int64, onText func(string)) (string, OutputEvent) {
	t.Helper()
	defer out.Close()
	var text strings.Builder
	var events []OutputEvent
	for out.Next() {
		ev := out.Event()
		events = append(events, ev)
		if ev.Type == EventStdout {
			text.Write(ev.Data)
			base += int64(len(ev.Data))
			if ev.Offset != base {
				t.Fatalf("offset %d after %q, want %d", ev.Offset, ev.Data, base)
			}
		}
		if onText != nil {
			onText(text.String())
		}
	}
	must(t, out.Err())
	exits := 0
	for _, ev := range events {
		if ev.Type == EventExit {
			exits++
		}
	}
	if exits != 1 || events[len(events)-1].Type != EventExit {
		t.Fatalf("events %+v", events)
	}
	return text.String(), events[len(events)-1]
}

func scenarioProcesses(t *testing.T, ctx context.Context, st *contract) {
	vm, err := st.c.Runtime.Schedule(ctx, AgentSpec{})
	must(t, err)
	defer func() {
		del, err := st.c.Runtime.Delete(context.Background(), vm.VMID)
		if err != nil || del.State != "terminated" {
			t.Errorf("delete %s: %v %+v", vm.VMID, err, del)
		}
	}()
	pr := st.c.Runtime.Processes
	p, err := pr.Start(ctx, vm.VMID, ProcessStart{Command: "/bin/sh", Argv: []string{"-c", contractPScript}, Stdin: true, Tag: "contract"})
	must(t, err)
	if p.ProcessID <= 0 || !p.Running {
		t.Fatalf("%+v", p)
	}
	list, err := pr.List(ctx, vm.VMID)
	must(t, err)
	listed := false
	for _, x := range list {
		listed = listed || (x.ProcessID == p.ProcessID && x.Tag == "contract")
	}
	if !listed {
		t.Fatalf("%d not listed: %+v", p.ProcessID, list)
	}
	must(t, pr.SendStdin(ctx, vm.VMID, p.ProcessID, []byte("hello\n")))
	must(t, pr.CloseStdin(ctx, vm.VMID, p.ProcessID))
	out, err := pr.Output(ctx, vm.VMID, p.ProcessID, 0)
	must(t, err)
	if text, exit := followOutput(t, out, 0, nil); text != "ready\ngot:hello\neof\n" || exit.ExitCode != 3 {
		t.Fatalf("%q %+v", text, exit)
	}
	done, err := pr.Wait(ctx, vm.VMID, p.ProcessID, 0)
	must(t, err)
	if done.Running || done.ExitCode == nil || *done.ExitCode != 3 {
		t.Fatalf("%+v", done)
	}
	out, err = pr.Output(ctx, vm.VMID, p.ProcessID, 6)
	must(t, err)
	if text, exit := followOutput(t, out, 6, nil); text != "got:hello\neof\n" || exit.ExitCode != 3 {
		t.Fatalf("from 6: %q %+v", text, exit)
	}

	q, err := pr.Start(ctx, vm.VMID, ProcessStart{Command: "/bin/sh", Argv: []string{"-c", contractQScript}})
	must(t, err)
	out, err = pr.Output(ctx, vm.VMID, q.ProcessID, 0)
	must(t, err)
	signalled := false
	text, exit := followOutput(t, out, 0, func(s string) {
		if strings.Contains(s, "armed") && !signalled {
			signalled = true
			must(t, pr.Signal(ctx, vm.VMID, q.ProcessID, "INT"))
		}
	})
	if !strings.Contains(text, "caught") || exit.ExitCode != 42 {
		t.Fatalf("%q %+v", text, exit)
	}

	term, err := pr.Terminal(ctx, vm.VMID, ProcessStart{Command: "/bin/sh", Argv: []string{"-c", "stty size; read x; stty size"}}, 80, 24)
	must(t, err)
	out, err = term.Output(ctx, 0)
	must(t, err)
	resized := false
	text, exit = followOutput(t, out, 0, func(s string) {
		if strings.Contains(s, "24 80") && !resized {
			resized = true
			must(t, term.Resize(ctx, 100, 30))
			must(t, term.Write(ctx, []byte("\n")))
		}
	})
	small, big := strings.Index(text, "24 80"), strings.Index(text, "30 100")
	if small < 0 || big < small || exit.ExitCode != 0 {
		t.Fatalf("%q %+v", text, exit)
	}

	contractAcrossAPause(t, ctx, st, vm.VMID)

	s, err := pr.Start(ctx, vm.VMID, ProcessStart{Command: "sleep", Argv: []string{"600"}})
	must(t, err)
	must(t, pr.Kill(ctx, vm.VMID, s.ProcessID))
	_, err = pr.Get(ctx, vm.VMID, s.ProcessID)
	expectAPIError(t, err, ErrNotFound, 404, "PROCESS_NOT_FOUND")
}

// contractAcrossAPause follows a process's output while its VM is live-paused and resumed:
// the stream reattaches by itself and no line is lost or repeated.
func contractAcrossAPause(t *testing.T, ctx context.Context, st *contract, vmID string) {
	pr := st.c.Runtime.Processes
	r, err := pr.Start(ctx, vmID, ProcessStart{Command: "/bin/sh", Argv: []string{"-c", contractRScript}})
	must(t, err)
	out, err := pr.Output(ctx, vmID, r.ProcessID, 0)
	must(t, err)
	var resumed chan error
	text, exit := followOutput(t, out, 0, func(s string) {
		if strings.Contains(s, "tick 3\n") && resumed == nil {
			p, err := st.c.Runtime.PauseVM(ctx, vmID, PauseLive(false))
			must(t, err)
			if p.State != "paused" {
				t.Fatalf("%+v", p)
			}
			resumed = make(chan error, 1)
			go func() { // resumed while the stream waits: it reattaches by itself
				_, err := st.c.Runtime.ResumeVM(ctx, vmID)
				if err == nil {
					_, err = st.c.Runtime.Exec(ctx, vmID, shell("touch /tmp/stop"))
				}
				resumed <- err
			}()
		}
	})
	if resumed == nil {
		t.Fatal("never paused")
	}
	must(t, <-resumed)
	lines := strings.Split(strings.TrimSuffix(text, "\n"), "\n")
	for i, line := range lines {
		if line != "tick "+strconv.Itoa(i+1) {
			t.Fatalf("line %d of %q", i, text)
		}
	}
	if len(lines) < 3 || exit.ExitCode != 0 {
		t.Fatalf("%q %+v", text, exit)
	}
}
