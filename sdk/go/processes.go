package pal

import (
	"context"
	"encoding/base64"
	"net/url"
	"strconv"
	"time"
)

// Processes are commands that outlive their request (the server's docs/processes.md):
// started in the background, read from any output offset, fed stdin, signalled, run on a
// terminal, waited for. The output journal lives inside the VM, so a process and its output
// survive a dropped connection, a pause of any kind, an idle suspend and a fork.

// Defaults of the process calls.
const (
	// DefaultReattachTimeout bounds how long an OutputStream keeps trying to reopen a
	// stream that cannot be opened (a VM paused by an operator, a server away).
	DefaultReattachTimeout = 300 * time.Second
	maxWaitPoll            = 60 * time.Second // the server's longest wait; longer waits poll again
	maxStdinChunk          = 1 << 20          // the server's bound on one stdin write
	processIDHdr           = "X-Pal-Process-Id"
)

// ProcessesService holds the calls on a VM's processes (Client.Runtime.Processes).
type ProcessesService struct {
	c *Client
}

// TerminalSize is a terminal's size in character cells.
type TerminalSize struct {
	Cols int `json:"cols"`
	Rows int `json:"rows"`
}

// ProcessStart starts a process, execve-style: Command is the executable and Argv its
// arguments. Every other field is optional.
type ProcessStart struct {
	Command     string            `json:"command"`
	Argv        []string          `json:"argv"`
	Env         map[string]string `json:"env,omitempty"`
	Cwd         string            `json:"cwd,omitempty"`
	User        string            `json:"user,omitempty"`
	TimeoutSecs float64           `json:"timeoutSecs,omitempty"` // 0: none
	// Stdin keeps a stdin pipe open for SendStdin.
	Stdin bool `json:"stdin,omitempty"`
	// PTY runs the command on a terminal of this size (its stdin is the terminal).
	PTY *TerminalSize `json:"pty,omitempty"`
	// Tag is free text to find the process by.
	Tag string `json:"tag,omitempty"`
	// KeepAwake makes the running process count as activity for idle suspend (bounded; see
	// the server's docs/processes.md).
	KeepAwake bool `json:"keepAwake,omitempty"`
	// JournalBytes is how much output the VM keeps for readers (0: the server's 8 MiB);
	// past it the oldest goes and a reader sees a gap.
	JournalBytes int `json:"journalBytes,omitempty"`
}

// JournalBounds are a process's output offsets: bytes before Start were dropped by the
// journal's bound (Capacity); End is the offset after the newest byte.
type JournalBounds struct {
	Start    int64 `json:"start"`
	End      int64 `json:"end"`
	Capacity int64 `json:"capacity"`
}

// Process is a process as the server shows it, running or exited.
type Process struct {
	ProcessID int64         `json:"processId"` // stable across pauses, restores and forks
	OSPid     int64         `json:"osPid"`     // its pid inside the guest
	Argv      []string      `json:"argv"`
	Tag       string        `json:"tag"`
	User      string        `json:"user"`
	Cwd       string        `json:"cwd"`
	PTY       *TerminalSize `json:"pty,omitempty"`
	Stdin     bool          `json:"stdin"` // its stdin is open for writes
	KeepAwake bool          `json:"keepAwake"`
	StartedMs int64         `json:"startedMs"`
	EndedMs   *int64        `json:"endedMs,omitempty"`
	Running   bool          `json:"running"`
	ExitCode  *int          `json:"exitCode,omitempty"` // set once it exited
	TimedOut  bool          `json:"timedOut"`
	Journal   JournalBounds `json:"journal"`
}

// ProcessOutput is one stream's bytes of a Read.
type ProcessOutput struct {
	Stream string `json:"stream"` // "stdout" or "stderr"
	Data   []byte `json:"data"`   // the bytes (base64 on the wire)
}

// ProcessRead answers Read: Gap bytes lost to the journal's bound before Output; Next is
// where the next read starts.
type ProcessRead struct {
	From    int64           `json:"from"`
	Next    int64           `json:"next"`
	Gap     int64           `json:"gap"`
	Output  []ProcessOutput `json:"output"`
	Process Process         `json:"process"`
}

// Start starts a process in the background and returns it (ProcessID names it in the
// other calls). Too many processes in the VM is a *APIError with Status 429.
func (p *ProcessesService) Start(ctx context.Context, vmID string, req ProcessStart) (*Process, error) {
	if req.Argv == nil {
		req.Argv = []string{}
	}
	var out Process
	return &out, p.c.doJSON(ctx, call{route: routeStartProcess, params: []string{vmID}, json: req}, &out)
}

// List returns the VM's processes, running and recently exited (with their exit codes).
func (p *ProcessesService) List(ctx context.Context, vmID string) ([]Process, error) {
	var out struct {
		Processes []Process `json:"processes"`
	}
	if err := p.c.doJSON(ctx, call{route: routeListProcesses, params: []string{vmID}}, &out); err != nil {
		return nil, err
	}
	return out.Processes, nil
}

// Get returns one process (ErrNotFound, code PROCESS_NOT_FOUND, for an unknown id).
func (p *ProcessesService) Get(ctx context.Context, vmID string, pid int64) (*Process, error) {
	var out Process
	return &out, p.c.doJSON(ctx, call{route: routeGetProcess, params: pidParams(vmID, pid)}, &out)
}

// Read reads the output from offset from once (a poll); wait > 0 (at most a minute) waits
// for output past it. Read on from the answer's Next.
func (p *ProcessesService) Read(ctx context.Context, vmID string, pid, from int64, wait time.Duration) (*ProcessRead, error) {
	q := url.Values{"from": {itoa(from)}, "waitMs": {itoa(int64(wait / time.Millisecond))}, "encoding": {"base64"}}
	var out ProcessRead // []byte fields decode from base64
	k := call{route: routeProcessOutput, params: pidParams(vmID, pid), query: q, stream: true}
	return &out, p.c.doJSON(ctx, k, &out)
}

// SendStdin writes all of data to the process's stdin. The server takes at most 1 MiB a
// call and may take less (a process that does not read): the rest is sent again.
func (p *ProcessesService) SendStdin(ctx context.Context, vmID string, pid int64, data []byte) error {
	for {
		part := data
		if len(part) > maxStdinChunk {
			part = part[:maxStdinChunk]
		}
		var out struct {
			Written int `json:"written"`
		}
		k := call{route: routeWriteStdin, params: pidParams(vmID, pid), body: part, hasBody: true}
		if err := p.c.doJSON(ctx, k, &out); err != nil {
			return err
		}
		data = data[out.Written:]
		if len(data) == 0 {
			return nil
		}
	}
}

// CloseStdin closes the process's stdin (a terminal gets ^D).
func (p *ProcessesService) CloseStdin(ctx context.Context, vmID string, pid int64) error {
	return p.c.doJSON(ctx, call{route: routeCloseStdin, params: pidParams(vmID, pid)}, nil)
}

// Signal sends a signal to the process's whole group: "INT", "TERM", "KILL", "HUP",
// "QUIT", "USR1", "USR2", "STOP", "CONT" or "WINCH".
func (p *ProcessesService) Signal(ctx context.Context, vmID string, pid int64, signal string) error {
	body := struct {
		Signal string `json:"signal"`
	}{signal}
	return p.c.doJSON(ctx, call{route: routeSignalProcess, params: pidParams(vmID, pid), json: body}, nil)
}

// ProcessStats are a process's figures from the guest's /proc, now (the process itself,
// not its children). The figures are nil once it ended.
type ProcessStats struct {
	ProcessID   int64  `json:"processId"`
	Running     bool   `json:"running"`
	State       string `json:"state"` // the kernel's state letter (R, S, D, T, Z), or "exited"
	CPUUserMs   *int64 `json:"cpuUserMs"`
	CPUSystemMs *int64 `json:"cpuSystemMs"`
	RSSBytes    *int64 `json:"rssBytes"`
	Threads     *int64 `json:"threads"`
}

// Stats reads the process's CPU time, resident memory, threads and state now.
func (p *ProcessesService) Stats(ctx context.Context, vmID string, pid int64) (*ProcessStats, error) {
	var out ProcessStats
	return &out, p.c.doJSON(ctx, call{route: routeProcessStats, params: pidParams(vmID, pid)}, &out)
}

// Resize gives the process's terminal a new size (the program gets SIGWINCH); ErrConflict
// for a process without a terminal.
func (p *ProcessesService) Resize(ctx context.Context, vmID string, pid int64, cols, rows int) error {
	body := TerminalSize{Cols: cols, Rows: rows}
	return p.c.doJSON(ctx, call{route: routeResizeProcess, params: pidParams(vmID, pid), json: body}, nil)
}

// AttachURL is a signed link that opens a process's WebSocket attach without the API key,
// for a browser's terminal (docs/processes.md, "WebSocket attach").
type AttachURL struct {
	URL       string `json:"url"`
	ExpiresAt int64  `json:"expiresAt"`
	LinkID    string `json:"linkId"`
}

// AttachURL returns a signed link to the process's WebSocket attach, valid for expires.
func (p *ProcessesService) AttachURL(ctx context.Context, vmID string, pid int64, expires time.Duration) (*AttachURL, error) {
	body := map[string]int64{"expiresInSecs": int64(expires.Seconds())}
	var out AttachURL
	if err := p.c.doJSON(ctx, call{route: routeAttachURL, params: pidParams(vmID, pid), json: body}, &out); err != nil {
		return nil, err
	}
	return &out, nil
}

// Kill kills the process (its group) and forgets it.
func (p *ProcessesService) Kill(ctx context.Context, vmID string, pid int64) error {
	return p.c.doJSON(ctx, call{route: routeKillProcess, params: pidParams(vmID, pid)}, nil)
}

// Wait returns the process once it exited, or as it is (Running) after timeout; 0 waits
// until it exits or ctx ends. A long wait is several of the server's long polls.
func (p *ProcessesService) Wait(ctx context.Context, vmID string, pid int64, timeout time.Duration) (*Process, error) {
	var deadline time.Time
	if timeout > 0 {
		deadline = time.Now().Add(timeout)
	}
	for {
		poll := maxWaitPoll
		if !deadline.IsZero() {
			if left := time.Until(deadline); left < poll {
				poll = left
			}
			if poll < 0 {
				poll = 0
			}
		}
		q := url.Values{"timeoutSecs": {strconv.FormatFloat(poll.Seconds(), 'f', 3, 64)}}
		var out Process
		k := call{route: routeWaitProcess, params: pidParams(vmID, pid), query: q, stream: true}
		if err := p.c.doJSON(ctx, k, &out); err != nil {
			return nil, err
		}
		if !out.Running || (!deadline.IsZero() && !time.Now().Before(deadline)) {
			return &out, nil
		}
	}
}

// Terminal starts req's command on a terminal of cols x rows and returns a handle to type
// into it, resize it and read it.
func (p *ProcessesService) Terminal(ctx context.Context, vmID string, req ProcessStart, cols, rows int) (*Terminal, error) {
	req.PTY, req.Stdin = &TerminalSize{Cols: cols, Rows: rows}, false
	proc, err := p.Start(ctx, vmID, req)
	if err != nil {
		return nil, err
	}
	return &Terminal{p: p, VMID: vmID, Process: *proc}, nil
}

// Terminal is a process on a terminal (ProcessesService.Terminal).
type Terminal struct {
	p *ProcessesService
	// VMID and Process say which process this is (Process as it was started).
	VMID    string
	Process Process
}

// Write types data into the terminal, as keys ("\x03" is ^C).
func (t *Terminal) Write(ctx context.Context, data []byte) error {
	return t.p.SendStdin(ctx, t.VMID, t.Process.ProcessID, data)
}

// Resize gives the terminal a new size.
func (t *Terminal) Resize(ctx context.Context, cols, rows int) error {
	return t.p.Resize(ctx, t.VMID, t.Process.ProcessID, cols, rows)
}

// Output follows what the terminal shows (one stream, stdout) from offset from.
func (t *Terminal) Output(ctx context.Context, from int64) (*OutputStream, error) {
	return t.p.Output(ctx, t.VMID, t.Process.ProcessID, from)
}

// Wait waits for the terminal's program to exit (see ProcessesService.Wait).
func (t *Terminal) Wait(ctx context.Context, timeout time.Duration) (*Process, error) {
	return t.p.Wait(ctx, t.VMID, t.Process.ProcessID, timeout)
}

// Kill kills the terminal's program (its group) and forgets it.
func (t *Terminal) Kill(ctx context.Context) error {
	return t.p.Kill(ctx, t.VMID, t.Process.ProcessID)
}

func pidParams(vmID string, pid int64) []string {
	return []string{vmID, itoa(pid)}
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

// decodeBase64 decodes an output event's data.
func decodeBase64(s string) ([]byte, error) { return base64.StdEncoding.DecodeString(s) }
