package pal

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
)

// Sentinel errors, for errors.Is on what a call returns. A *APIError matches the sentinel
// of its HTTP status (ErrServer matches every 5xx besides its own sentinel).
var (
	// ErrBadRequest: 400, an invalid request (bad argument, a path leaving /workspace...).
	ErrBadRequest = errors.New("pal: bad request")
	// ErrUnauthorized: 401, a missing or invalid API key.
	ErrUnauthorized = errors.New("pal: unauthorized")
	// ErrQuota: 402, the tenant's quota (running VMs, snapshots...) is exhausted.
	ErrQuota = errors.New("pal: quota exceeded")
	// ErrForbidden: 403, this key or client may not do this.
	ErrForbidden = errors.New("pal: forbidden")
	// ErrNotFound: 404, an unknown VM (or another tenant's), file or route.
	ErrNotFound = errors.New("pal: not found")
	// ErrConflict: 409, the VM is in the wrong lifecycle state for this call.
	ErrConflict = errors.New("pal: conflict")
	// ErrTooLarge: 413, a body over the server's limit (files: 1 MiB).
	ErrTooLarge = errors.New("pal: payload too large")
	// ErrUnavailable: 503, the backend cannot do it now.
	ErrUnavailable = errors.New("pal: unavailable")
	// ErrGuestTimeout: 504, the sandbox did not answer in time.
	ErrGuestTimeout = errors.New("pal: guest timeout")
	// ErrServer: any 5xx answer.
	ErrServer = errors.New("pal: server error")
	// ErrConnection: no HTTP answer at all (wrong PAL_URL, server down, network error).
	ErrConnection = errors.New("pal: cannot reach the server")
	// ErrTruncated: ReadFile's file was larger than the server sends (1 MiB); the bytes
	// returned with it are its beginning.
	ErrTruncated = errors.New("pal: file truncated by the server")
	// ErrStreamEnded: an exec stream ended without an exit or error event.
	ErrStreamEnded = errors.New("pal: exec stream ended before the command did")
)

var sentinelByStatus = map[int]error{
	400: ErrBadRequest,
	401: ErrUnauthorized,
	402: ErrQuota,
	403: ErrForbidden,
	404: ErrNotFound,
	409: ErrConflict,
	413: ErrTooLarge,
	503: ErrUnavailable,
	504: ErrGuestTimeout,
}

// APIError is the server's refusal of a call: `{"error": {"code", "message", "requestId"}}`
// with its HTTP status.
type APIError struct {
	// Status is the HTTP status code (404, 409...).
	Status int
	// Code is the server's error code, e.g. NOT_FOUND, FAILED_PRECONDITION, QUOTA_EXCEEDED,
	// PATH_ESCAPE; HTTP_ERROR when the answer carried no Pal error body.
	Code string
	// Message says what went wrong, in words.
	Message string
	// RequestID is the request's X-Request-Id: the server's log has the details under it.
	RequestID string
}

// Error formats the status, code, message and request id.
func (e *APIError) Error() string {
	s := fmt.Sprintf("pal: %d %s: %s", e.Status, e.Code, e.Message)
	if e.RequestID != "" {
		s += " (request " + e.RequestID + ")"
	}
	return s
}

// Is reports whether target is the sentinel of e's status (ErrNotFound for 404...), or
// ErrServer for a 5xx.
func (e *APIError) Is(target error) bool {
	if s, ok := sentinelByStatus[e.Status]; ok && s == target {
		return true
	}
	return target == ErrServer && e.Status >= 500
}

// ConnectionError is a call that got no HTTP answer: the server could not be reached, or
// the connection broke before the answer came.
type ConnectionError struct {
	// URL is the server's base URL.
	URL string
	// Err is the transport's error.
	Err error
}

// Error names the server and the transport's error.
func (e *ConnectionError) Error() string {
	return fmt.Sprintf("pal: cannot reach Pal at %s: %v", e.URL, e.Err)
}

// Unwrap returns the transport's error.
func (e *ConnectionError) Unwrap() error { return e.Err }

// Is matches ErrConnection.
func (e *ConnectionError) Is(target error) bool { return target == ErrConnection }

// errorFromBody builds the *APIError of a non-2xx answer.
func errorFromBody(status int, body []byte, requestID string) *APIError {
	var wire struct {
		Error *struct {
			Code      string  `json:"code"`
			Message   string  `json:"message"`
			RequestID *string `json:"requestId"`
		} `json:"error"`
	}
	if json.Unmarshal(body, &wire) == nil && wire.Error != nil {
		e := &APIError{Status: status, Code: wire.Error.Code, Message: wire.Error.Message, RequestID: requestID}
		if e.Code == "" {
			e.Code = "ERROR"
		}
		if wire.Error.RequestID != nil {
			e.RequestID = *wire.Error.RequestID
		}
		return e
	}
	text := strings.TrimSpace(string(body))
	if len(text) > 500 {
		text = text[:500]
	}
	if text == "" {
		text = fmt.Sprintf("HTTP %d", status)
	}
	return &APIError{Status: status, Code: "HTTP_ERROR", Message: text, RequestID: requestID}
}
