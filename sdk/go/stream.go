package pal

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
)

// Kinds of ExecEvent.
const (
	EventStdout = "stdout" // Data is a chunk of standard output
	EventStderr = "stderr" // Data is a chunk of standard error
	EventExit   = "exit"   // the command ended: ExitCode, TimedOut
	EventError  = "error"  // it could not run or was cut off: Code, Message
)

// maxSSELine bounds one line of the event stream (a stdout chunk is far smaller).
const maxSSELine = 4 << 20

// ExecEvent is one event of a streamed exec, in the order the command produced them.
type ExecEvent struct {
	// Type is EventStdout, EventStderr, EventExit or EventError.
	Type string
	// Data is the output of a stdout or stderr event; for an error event, "CODE: message\n"
	// (so a loop printing Data for every event but exit shows errors too).
	Data string
	// ExitCode is the exit event's status.
	ExitCode int
	// TimedOut is set on the exit event of a command the server stopped at its timeout.
	TimedOut bool
	// Code and Message describe an error event.
	Code    string
	Message string
}

// ExecStream iterates the events of a streamed exec:
//
//	for stream.Next() {
//		ev := stream.Event()
//		...
//	}
//	if err := stream.Err(); err != nil { ... }
//
// The stream ends after the exit or error event. Close it (or cancel the context given
// to ExecStream) to stop early: that closes the connection, which stops the command in
// the guest. ExecStream is not safe for concurrent use, except Close.
type ExecStream struct {
	body    io.ReadCloser
	url     string
	cancel  context.CancelFunc
	ctx     context.Context
	scanner *bufio.Scanner
	ev      ExecEvent
	err     error
	done    bool
	once    sync.Once
	pid     int64 // the command's process (ProcessID)
}

// ExecStream starts a command and returns its event stream. Errors before the command
// starts (ErrNotFound, ErrConflict, ErrQuota...) are returned here.
func (r *RuntimeService) ExecStream(ctx context.Context, vmID string, req ExecRequest) (*ExecStream, error) {
	ctx, cancel := context.WithCancel(ctx)
	k := call{route: routeExec, params: []string{vmID}, json: execBody(req), accept: "text/event-stream", stream: true}
	resp, done, err := r.c.do(ctx, k)
	if err != nil {
		cancel()
		return nil, err
	}
	done() // a stream call has no timeout of its own; cancel covers it
	if !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		resp.Body.Close()
		cancel()
		return nil, &APIError{Status: resp.StatusCode, Code: "BAD_RESPONSE",
			Message: "expected an event stream, got " + resp.Header.Get("Content-Type"), RequestID: resp.Header.Get(requestIDHdr)}
	}
	s := newExecStream(ctx, cancel, resp, r.c.baseURL)
	s.pid, _ = strconv.ParseInt(resp.Header.Get(processIDHdr), 10, 64)
	return s, nil
}

func newExecStream(ctx context.Context, cancel context.CancelFunc, resp *http.Response, base string) *ExecStream {
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 0, 64<<10), maxSSELine)
	return &ExecStream{body: resp.Body, url: base, cancel: cancel, ctx: ctx, scanner: sc}
}

// Next advances to the next event; false at the end of the stream or on an error (see
// Err).
func (s *ExecStream) Next() bool {
	if s.done {
		return false
	}
	name, data := "message", []string(nil)
	for s.scanner.Scan() {
		line := s.scanner.Text()
		if line == "" {
			if data == nil {
				name = "message"
				continue
			}
			if name == "process" { // the command's process id, before its output
				s.setProcessID(strings.Join(data, "\n"))
				name, data = "message", nil
				continue
			}
			ev, ok := toEvent(name, strings.Join(data, "\n"))
			name, data = "message", nil
			if !ok {
				continue // an event kind this SDK does not know
			}
			s.ev = ev
			if ev.Type == EventExit || ev.Type == EventError {
				s.finish(nil)
			}
			return true
		}
		if strings.HasPrefix(line, ":") {
			continue // keepalive comment
		}
		field, value, _ := strings.Cut(line, ":")
		value = strings.TrimPrefix(value, " ")
		switch field {
		case "event":
			name = value
		case "data":
			data = append(data, value)
		}
	}
	err := s.scanner.Err()
	switch {
	case s.ctx.Err() != nil:
		err = s.ctx.Err()
	case err != nil:
		err = &ConnectionError{URL: s.url, Err: err}
	default:
		err = ErrStreamEnded
	}
	s.finish(err)
	return false
}

// Event returns the event Next moved to.
func (s *ExecStream) Event() ExecEvent { return s.ev }

// ProcessID is the command's process id (0 until the server named it, which it does before
// the first output): after a dropped stream, Runtime.Processes.Output reads on from it.
func (s *ExecStream) ProcessID() int64 { return s.pid }

func (s *ExecStream) setProcessID(data string) {
	var p struct {
		ProcessID int64 `json:"processId"`
	}
	if json.Unmarshal([]byte(data), &p) == nil && p.ProcessID > 0 {
		s.pid = p.ProcessID
	}
}

// Err returns what ended the stream early: the context's error after a cancel,
// ErrStreamEnded when the server closed it before the command ended, a *ConnectionError
// for a broken connection. Nil after an exit or error event, and after Close.
func (s *ExecStream) Err() error { return s.err }

// Close stops the stream; a command still running is stopped in the guest. Safe to call
// more than once, and from another goroutine.
func (s *ExecStream) Close() error {
	s.once.Do(func() {
		s.cancel()
		s.body.Close()
	})
	return nil
}

func (s *ExecStream) finish(err error) {
	s.done = true
	if err != nil && !(errors.Is(err, context.Canceled) && s.closedByUs()) {
		s.err = err
	}
	s.Close()
}

// closedByUs: Close was called (its cancel is what ended the read).
func (s *ExecStream) closedByUs() bool {
	called := true
	s.once.Do(func() { called = false; s.cancel(); s.body.Close() })
	return called
}

// toEvent decodes one server-sent event; false for a kind this SDK does not know.
func toEvent(name, data string) (ExecEvent, bool) {
	var p struct {
		Data     string `json:"data"`
		ExitCode *int   `json:"exitCode"`
		TimedOut bool   `json:"timedOut"`
		Code     string `json:"code"`
		Message  string `json:"message"`
	}
	if data != "" && json.Unmarshal([]byte(data), &p) != nil {
		p.Data = data
	}
	switch name {
	case EventStdout, EventStderr:
		return ExecEvent{Type: name, Data: p.Data}, true
	case EventExit:
		code := -1
		if p.ExitCode != nil {
			code = *p.ExitCode
		}
		return ExecEvent{Type: EventExit, ExitCode: code, TimedOut: p.TimedOut}, true
	case EventError:
		if p.Code == "" {
			p.Code = "ERROR"
		}
		return ExecEvent{Type: EventError, Code: p.Code, Message: p.Message, Data: p.Code + ": " + p.Message + "\n"}, true
	}
	return ExecEvent{}, false
}
