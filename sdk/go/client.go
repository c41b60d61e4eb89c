package pal

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"math/rand"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"
)

// Version is this SDK's version, sent in the default User-Agent.
const Version = "0.1.0"

// DefaultURL is the server the client talks to when neither WithURL nor PAL_URL says.
const DefaultURL = "http://127.0.0.1:8080"

// Defaults of the client's options.
const (
	DefaultTimeout = 120 * time.Second // per call, except Exec and ExecStream
	DefaultRetries = 3                 // retries after the first attempt
	retryBase      = 200 * time.Millisecond
	retryCap       = 3 * time.Second
	truncatedHdr   = "X-Pal-Truncated"
	requestIDHdr   = "X-Request-Id"
	maxErrorBody   = 64 << 10 // bytes of an error answer read
)

// Client talks to one Pal server. It is safe for concurrent use.
type Client struct {
	// Runtime holds the /v1/runtime calls: sandboxes, exec, files, pause, resume, fork.
	Runtime *RuntimeService
	// Images lists the images a tenant may schedule.
	Images *ImagesService
	// Volumes holds the /v1/volumes calls: storage that outlives a VM (volumes.go).
	Volumes *VolumesService

	baseURL   string
	apiKey    string
	http      *http.Client
	userAgent string
	timeout   time.Duration
	retries   int
}

// Option configures a Client (NewClient's arguments).
type Option func(*Client)

// WithURL sets the server's URL (default: PAL_URL, else DefaultURL).
func WithURL(u string) Option { return func(c *Client) { c.baseURL = u } }

// WithAPIKey sets the tenant API key (default: PAL_API_KEY).
func WithAPIKey(key string) Option { return func(c *Client) { c.apiKey = key } }

// WithHTTPClient sets the *http.Client requests go through (default: a new one with no
// overall timeout, since exec streams may last long; see WithTimeout).
func WithHTTPClient(h *http.Client) Option { return func(c *Client) { c.http = h } }

// WithUserAgent sets the User-Agent header (default "pal-go/<Version>").
func WithUserAgent(ua string) Option { return func(c *Client) { c.userAgent = ua } }

// WithTimeout bounds each call but Exec and ExecStream (which the server bounds with the
// request's TimeoutSecs, and the caller with its context). 0: no bound. Default 120 s.
func WithTimeout(d time.Duration) Option { return func(c *Client) { c.timeout = d } }

// WithRetries sets how many times a safe call is retried (default 3; 0: never). See the
// package documentation for which calls are safe.
func WithRetries(n int) Option { return func(c *Client) { c.retries = n } }

// NewClient makes a client. Without options it talks to PAL_URL (else DefaultURL) with
// the key in PAL_API_KEY.
func NewClient(opts ...Option) *Client {
	c := &Client{
		baseURL:   os.Getenv("PAL_URL"),
		apiKey:    os.Getenv("PAL_API_KEY"),
		userAgent: "pal-go/" + Version,
		timeout:   DefaultTimeout,
		retries:   DefaultRetries,
	}
	for _, o := range opts {
		o(c)
	}
	if c.baseURL == "" {
		c.baseURL = DefaultURL
	}
	c.baseURL = strings.TrimRight(c.baseURL, "/")
	if c.http == nil {
		c.http = &http.Client{}
	}
	if c.retries < 0 {
		c.retries = 0
	}
	c.Runtime = &RuntimeService{c: c, Processes: &ProcessesService{c: c}}
	c.Images = &ImagesService{c: c}
	c.Volumes = &VolumesService{c: c}
	return c
}

// URL is the server's base URL this client talks to.
func (c *Client) URL() string { return c.baseURL }

// Health calls GET /healthz: OK is false when the server cannot schedule VMs (the answer
// is then 503, which Health reports as a *APIError).
func (c *Client) Health(ctx context.Context) (*Health, error) {
	var out Health
	return &out, c.doJSON(ctx, call{route: routeHealth}, &out)
}

// call is one request: its route and path parameters, query, and body.
type call struct {
	route   route
	params  []string
	query   url.Values
	json    interface{} // a JSON body, or
	body    []byte      // raw bytes (application/octet-stream)
	hasBody bool
	accept  string
	stream  bool // no client timeout (exec): the server and the caller's context bound it
}

// doJSON makes the call and decodes its JSON answer into out (when out is not nil).
func (c *Client) doJSON(ctx context.Context, k call, out interface{}) error {
	resp, cancel, err := c.do(ctx, k)
	if err != nil {
		return err
	}
	defer cancel()
	defer resp.Body.Close()
	if out == nil {
		_, err = io.Copy(io.Discard, resp.Body)
		return wrapTransport(err, c.baseURL)
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		var syntax *json.SyntaxError
		var typ *json.UnmarshalTypeError
		if !errors.As(err, &syntax) && !errors.As(err, &typ) {
			return wrapTransport(err, c.baseURL) // the connection broke (or ctx ended) mid-answer
		}
		return &APIError{Status: resp.StatusCode, Code: "BAD_RESPONSE", Message: "cannot decode the answer: " + err.Error(),
			RequestID: resp.Header.Get(requestIDHdr)}
	}
	return nil
}

// do sends the call, retrying where safe, and returns a 2xx answer whose body the caller
// must close, then call cancel (which ends the call's own timeout).
func (c *Client) do(ctx context.Context, k call) (*http.Response, context.CancelFunc, error) {
	path, err := k.route.expand(k.params...)
	if err != nil {
		return nil, nil, err
	}
	u := c.baseURL + path
	if len(k.query) > 0 {
		u += "?" + k.query.Encode()
	}
	var body []byte
	if k.json != nil {
		if body, err = json.Marshal(k.json); err != nil {
			return nil, nil, err
		}
	} else if k.hasBody {
		body = k.body
	}
	cancel := context.CancelFunc(func() {})
	if c.timeout > 0 && !k.stream {
		ctx, cancel = context.WithTimeout(ctx, c.timeout)
	}
	for attempt := 0; ; attempt++ {
		resp, err := c.send(ctx, k, u, body)
		if err == nil && resp.StatusCode < 300 {
			return resp, cancel, nil
		}
		if err == nil {
			err = readError(resp)
		}
		if attempt >= c.retries || !retryable(k.route.method, err) || ctx.Err() != nil {
			cancel()
			return nil, nil, err
		}
		if werr := sleep(ctx, backoff(attempt)); werr != nil {
			cancel()
			return nil, nil, err
		}
	}
}

// send makes one attempt.
func (c *Client) send(ctx context.Context, k call, u string, body []byte) (*http.Response, error) {
	var rd io.Reader
	if k.json != nil || k.hasBody {
		rd = bytes.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, k.route.method, u, rd)
	if err != nil {
		return nil, err
	}
	if c.apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+c.apiKey)
	}
	req.Header.Set("User-Agent", c.userAgent)
	if k.json != nil {
		req.Header.Set("Content-Type", "application/json")
	} else if k.hasBody {
		req.Header.Set("Content-Type", "application/octet-stream")
	}
	if k.accept != "" {
		req.Header.Set("Accept", k.accept)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, &ConnectionError{URL: c.baseURL, Err: err}
	}
	return resp, nil
}

// readError reads and closes a non-2xx answer.
func readError(resp *http.Response) error {
	defer resp.Body.Close()
	data, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
	return errorFromBody(resp.StatusCode, data, resp.Header.Get(requestIDHdr))
}

// retryable: a GET after a connection error or a 502/503/504; any call whose connection
// could not even be made (nothing was sent).
func retryable(method string, err error) bool {
	var apiErr *APIError
	if errors.As(err, &apiErr) {
		return method == http.MethodGet && (apiErr.Status == 502 || apiErr.Status == 503 || apiErr.Status == 504)
	}
	var connErr *ConnectionError
	if !errors.As(err, &connErr) {
		return false
	}
	if method == http.MethodGet {
		return true
	}
	var opErr *net.OpError
	return errors.As(connErr.Err, &opErr) && opErr.Op == "dial"
}

// backoff is the wait before retry n+1: exponential from retryBase, capped, with jitter.
func backoff(n int) time.Duration {
	d := retryBase << uint(n)
	if d > retryCap || d <= 0 {
		d = retryCap
	}
	return d/2 + time.Duration(rand.Int63n(int64(d/2)+1))
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// wrapTransport turns a body read's error into a *ConnectionError (context errors stay).
func wrapTransport(err error, base string) error {
	if err == nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return &ConnectionError{URL: base, Err: err}
}
