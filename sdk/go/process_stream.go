package pal

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"
)

// EventGap is the kind of OutputEvent that says Lost bytes of output were dropped by the
// process's journal bound before the next event (the other kinds are EventStdout,
// EventStderr and EventExit).
const EventGap = "gap"

const (
	streamErrorCode      = "STREAM_ERROR" // an error event's *APIError
	reattachBackoffStart = 200 * time.Millisecond
	reattachBackoffMax   = 2 * time.Second
)

// OutputEvent is one event of a process's output, in order.
type OutputEvent struct {
	// Type is EventStdout, EventStderr, EventGap or EventExit.
	Type string
	// Data is a stdout or stderr event's bytes.
	Data []byte
	// Offset is the journal offset after this event's bytes (after the lost ones for a
	// gap): resuming Output there neither skips nor repeats a byte.
	Offset int64
	// Lost is a gap event's count of dropped bytes.
	Lost int64
	// ExitCode and TimedOut are the exit event's status.
	ExitCode int
	TimedOut bool
}

// errDetached: the stream ended while the process may run on (a "detached" event, or the
// body ended without an exit): reattach.
var errDetached = errors.New("pal: output stream detached")

// OutputStream follows a process's output; it reattaches by itself from the last offset it
// gave when the connection drops or the server detaches the stream (the VM paused, moved or
// its node restarted), waking an idle-suspended VM as an exec does, and waiting (up to
// DefaultReattachTimeout) for a VM paused by an operator. So every byte arrives once, in
// order, then one exit event:
//
//	for out.Next() {
//		ev := out.Event()
//		...
//	}
//	if err := out.Err(); err != nil { ... }
//
// Close it, or cancel the context given to Output, to stop reading; the process runs on.
// OutputStream is not safe for concurrent use, except Close.
type OutputStream struct {
	p       *ProcessesService
	ctx     context.Context
	cancel  context.CancelFunc
	vmID    string
	pid     int64
	offset  int64
	body    io.ReadCloser
	scanner *bufio.Scanner
	ev      OutputEvent
	err     error
	done    bool
	since   time.Time // the last progress, for the reattach timeout
	backoff time.Duration
	once    sync.Once
}

// Output follows process pid's output from offset from (0: its beginning). Errors opening
// it (ErrNotFound, ErrBadRequest for an offset past the end) are returned here.
func (p *ProcessesService) Output(ctx context.Context, vmID string, pid, from int64) (*OutputStream, error) {
	ctx, cancel := context.WithCancel(ctx)
	s := &OutputStream{p: p, ctx: ctx, cancel: cancel, vmID: vmID, pid: pid, offset: from,
		since: time.Now(), backoff: reattachBackoffStart}
	if err := s.open(); err != nil && !mayReattach(err) {
		cancel()
		return nil, err
	}
	return s, nil
}

// open attaches from the current offset.
func (s *OutputStream) open() error {
	q := url.Values{"from": {itoa(s.offset)}, "encoding": {"base64"}}
	k := call{route: routeProcessOutput, params: pidParams(s.vmID, s.pid), query: q,
		accept: "text/event-stream", stream: true}
	resp, done, err := s.p.c.do(s.ctx, k)
	if err != nil {
		return err
	}
	done() // a stream call has no timeout of its own; the context covers it
	if !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		resp.Body.Close()
		return &APIError{Status: resp.StatusCode, Code: "BAD_RESPONSE",
			Message: "expected an event stream, got " + resp.Header.Get("Content-Type"), RequestID: resp.Header.Get(requestIDHdr)}
	}
	s.body = resp.Body
	s.scanner = bufio.NewScanner(resp.Body)
	s.scanner.Buffer(make([]byte, 0, 64<<10), maxSSELine)
	return nil
}

// Next advances to the next event, reattaching as needed; false after the exit event or on
// an error that reattaching cannot cure (see Err).
func (s *OutputStream) Next() bool {
	for !s.done {
		if s.body == nil {
			if err := s.open(); err != nil {
				s.retryOrFinish(err)
				continue
			}
		}
		ev, err := s.read()
		if err == nil {
			s.ev, s.since, s.backoff = ev, time.Now(), reattachBackoffStart
			if ev.Type == EventExit {
				s.finish(nil)
			} else {
				s.offset = ev.Offset
			}
			return true
		}
		s.body.Close()
		s.body = nil
		s.retryOrFinish(err)
	}
	return false
}

// retryOrFinish waits before the next attach, or ends the stream when err is final.
func (s *OutputStream) retryOrFinish(err error) {
	if s.ctx.Err() != nil {
		s.finish(s.ctx.Err())
		return
	}
	if !errors.Is(err, errDetached) && (!mayReattach(err) || time.Since(s.since) > DefaultReattachTimeout) {
		s.finish(err)
		return
	}
	if serr := sleep(s.ctx, s.backoff); serr != nil {
		s.finish(serr)
		return
	}
	if s.backoff *= 2; s.backoff > reattachBackoffMax {
		s.backoff = reattachBackoffMax
	}
}

// read returns the next event of the open stream.
func (s *OutputStream) read() (OutputEvent, error) {
	name, id, data := "message", "", []string(nil)
	for s.scanner.Scan() {
		line := s.scanner.Text()
		if line == "" {
			if data == nil {
				name, id = "message", ""
				continue
			}
			ev, ok, err := toOutputEvent(name, id, strings.Join(data, "\n"))
			name, id, data = "message", "", nil
			if err != nil {
				return OutputEvent{}, err
			}
			if ok {
				return ev, nil
			}
			continue // an event kind this SDK does not know
		}
		if strings.HasPrefix(line, ":") {
			continue // keepalive comment
		}
		field, value, _ := strings.Cut(line, ":")
		value = strings.TrimPrefix(value, " ")
		switch field {
		case "event":
			name = value
		case "id":
			id = value
		case "data":
			data = append(data, value)
		}
	}
	if err := s.scanner.Err(); err != nil {
		if s.ctx.Err() != nil {
			return OutputEvent{}, s.ctx.Err()
		}
		return OutputEvent{}, &ConnectionError{URL: s.p.c.baseURL, Err: err}
	}
	return OutputEvent{}, errDetached // ended without an exit
}

// Event returns the event Next moved to.
func (s *OutputStream) Event() OutputEvent { return s.ev }

// Offset is the journal offset after the last event Next gave: Output from there resumes
// exactly where this stream stands.
func (s *OutputStream) Offset() int64 { return s.offset }

// Err returns what ended the stream early: the context's error after a cancel, an error
// event or refusal from the server (a *APIError), or the last reattach error once
// DefaultReattachTimeout passed without progress. Nil after the exit event and after Close.
func (s *OutputStream) Err() error { return s.err }

// Close stops reading (the process runs on). Safe to call more than once, and from another
// goroutine.
func (s *OutputStream) Close() error {
	s.once.Do(func() {
		s.cancel()
		if s.body != nil {
			s.body.Close()
		}
	})
	return nil
}

func (s *OutputStream) finish(err error) {
	s.done = true
	closed := true
	s.once.Do(func() { closed = false })
	if err != nil && !(closed && errors.Is(err, context.Canceled)) {
		s.err = err
	}
	s.cancel()
	if s.body != nil {
		s.body.Close()
		s.body = nil
	}
}

// mayReattach: a stream that could not be (re)opened for a while: the VM is paused (409,
// until it is resumed), the server or its node is away (no answer, 502/503/504).
func mayReattach(err error) bool {
	var apiErr *APIError
	if errors.As(err, &apiErr) {
		if apiErr.Code == streamErrorCode {
			return false // the server's error event: final
		}
		return apiErr.Status == http.StatusConflict || apiErr.Status == 502 || apiErr.Status == 503 || apiErr.Status == 504
	}
	return errors.Is(err, ErrConnection)
}

// toOutputEvent decodes one server-sent event of /output?encoding=base64; false for a kind
// this SDK does not know; errDetached for a detached event; a *APIError for an error event.
func toOutputEvent(name, id, data string) (OutputEvent, bool, error) {
	var p struct {
		Data     string `json:"data"`
		Lost     int64  `json:"lost"`
		ExitCode *int   `json:"exitCode"`
		TimedOut bool   `json:"timedOut"`
		Code     string `json:"code"`
		Message  string `json:"message"`
	}
	if data != "" && json.Unmarshal([]byte(data), &p) != nil {
		return OutputEvent{}, false, nil
	}
	offset, _ := strconv.ParseInt(id, 10, 64)
	switch name {
	case EventStdout, EventStderr:
		raw, err := decodeBase64(p.Data)
		if err != nil {
			return OutputEvent{}, false, &APIError{Status: 502, Code: "BAD_RESPONSE", Message: "output data is not base64"}
		}
		return OutputEvent{Type: name, Data: raw, Offset: offset}, true, nil
	case EventGap:
		return OutputEvent{Type: EventGap, Lost: p.Lost, Offset: offset}, true, nil
	case EventExit:
		code := -1
		if p.ExitCode != nil {
			code = *p.ExitCode
		}
		return OutputEvent{Type: EventExit, ExitCode: code, TimedOut: p.TimedOut}, true, nil
	case "detached":
		return OutputEvent{}, false, errDetached
	case EventError:
		return OutputEvent{}, false, &APIError{Status: 503, Code: streamErrorCode, Message: p.Code + ": " + p.Message}
	}
	return OutputEvent{}, false, nil
}
