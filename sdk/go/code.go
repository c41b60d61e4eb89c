package pal

import (
	"context"
	"encoding/base64"
)

// CodeRequest is one cell for RunCode (docs/agents.md "Code interpreter").
type CodeRequest struct {
	Code        string  `json:"code"`
	Language    string  `json:"language,omitempty"`  // "python" (default) or "bash"
	ContextID   string  `json:"contextId,omitempty"` // default: the language's default context
	TimeoutSecs float64 `json:"timeoutSecs,omitempty"`
}

// CodeError is a cell's exception.
type CodeError struct {
	Name      string   `json:"name"`
	Value     string   `json:"value"`
	Traceback []string `json:"traceback"`
}

// CodeResult is a cell's answer. Results are MIME bundles ("text/plain", "text/html",
// "image/png" as base64, "image/svg+xml", "application/json") with "isMainResult".
type CodeResult struct {
	ContextID      string                   `json:"contextId"`
	ExecutionCount *int                     `json:"executionCount"`
	Stdout         string                   `json:"stdout"`
	Stderr         string                   `json:"stderr"`
	Results        []map[string]interface{} `json:"results"`
	Text           *string                  `json:"text"`
	Error          *CodeError               `json:"error"`
	TimedOut       bool                     `json:"timedOut"`
}

// PNGs returns the cell's image/png results, decoded.
func (r *CodeResult) PNGs() [][]byte {
	var out [][]byte
	for _, res := range r.Results {
		if s, ok := res["image/png"].(string); ok {
			if b, err := base64.StdEncoding.DecodeString(s); err == nil {
				out = append(out, b)
			}
		}
	}
	return out
}

// CodeContext is one kernel of a VM.
type CodeContext struct {
	ContextID  string `json:"contextId"`
	Language   string `json:"language"`
	Cwd        string `json:"cwd"`
	CreatedMs  int64  `json:"createdMs"`
	Executions int    `json:"executions"`
	Running    bool   `json:"running"`
}

// RunCode runs a cell in the VM's stateful kernel; variables persist between cells.
func (r *RuntimeService) RunCode(ctx context.Context, vmID string, req CodeRequest) (*CodeResult, error) {
	var out CodeResult
	k := call{route: routeRunCode, params: []string{vmID}, json: req, stream: true}
	return &out, r.c.doJSON(ctx, k, &out)
}

// CreateContext starts a context of its own (a separate kernel).
func (r *RuntimeService) CreateContext(ctx context.Context, vmID, language, cwd string, env map[string]string) (*CodeContext, error) {
	body := map[string]interface{}{"language": language, "env": env}
	if env == nil {
		body["env"] = map[string]string{}
	}
	if cwd != "" {
		body["cwd"] = cwd
	}
	var out CodeContext
	return &out, r.c.doJSON(ctx, call{route: routeNewContext, params: []string{vmID}, json: body, stream: true}, &out)
}

// ListContexts lists the VM's code contexts.
func (r *RuntimeService) ListContexts(ctx context.Context, vmID string) ([]CodeContext, error) {
	var out struct {
		Contexts []CodeContext `json:"contexts"`
	}
	err := r.c.doJSON(ctx, call{route: routeListContexts, params: []string{vmID}}, &out)
	return out.Contexts, err
}

// DeleteContext stops a context's kernel.
func (r *RuntimeService) DeleteContext(ctx context.Context, vmID, contextID string) error {
	return r.c.doJSON(ctx, call{route: routeDelContext, params: []string{vmID, contextID}}, nil)
}

// InterruptContext interrupts the cell running in a context; false when none ran.
func (r *RuntimeService) InterruptContext(ctx context.Context, vmID, contextID string) (bool, error) {
	var out struct {
		Interrupted bool `json:"interrupted"`
	}
	err := r.c.doJSON(ctx, call{route: routeInterrupt, params: []string{vmID, contextID}}, &out)
	return out.Interrupted, err
}
