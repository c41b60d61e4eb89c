// Package pal is the Go SDK of Pal, the self-hostable microVM sandbox runtime for AI
// agents: schedule sandboxes, run commands in them (buffered or streamed) or as background
// processes, read and write their files, pause, resume and fork them, over Pal's REST API.
//
// It uses the standard library only. Import it as
//
//	import pal "github.com/pal-sandbox/pal/sdk/go"
//
// and make a client; NewClient reads PAL_URL (default http://127.0.0.1:8080) and
// PAL_API_KEY:
//
//	client := pal.NewClient()
//	vm, err := client.Runtime.Schedule(ctx, pal.AgentSpec{Image: "default"})
//
// # Layout
//
//   - client.go: Client, NewClient and its options, the one request path (auth, retries).
//   - routes.go: every REST route the SDK calls, in one table (the drift test reads it).
//   - runtime.go: Client.Runtime, the /v1/runtime calls (Schedule, Get, List, Delete,
//     PauseVM, ResumeVM, ForkVM, Exec, egress, secrets, port links, events, metrics,
//     snapshots); files.go: ListFiles, ReadFile, WriteFile, DeleteFile.
//   - stream.go: ExecStream, the streamed exec iterator (server-sent events).
//   - Client.Images (in runtime.go) lists images.
//   - errors.go: *APIError and the sentinels for errors.Is (ErrNotFound, ErrConflict...).
//   - types.go: the request and answer shapes (the server's /openapi.json is their truth).
//   - processes.go: Client.Runtime.Processes, processes that outlive the request (Start,
//     List, Get, Read, SendStdin, CloseStdin, Signal, Resize, Kill, Wait, Terminal);
//     process_stream.go: OutputStream, their output, which reattaches by itself.
//
// # Errors
//
// A call the server refuses returns a *APIError carrying the HTTP status, the server's
// error code, its message and the request id; test it with errors.Is against the
// sentinels (ErrNotFound, ErrConflict, ErrQuota, ErrUnauthorized...), or errors.As to read
// its fields. A server that cannot be reached gives a *ConnectionError (errors.Is
// ErrConnection).
//
// # Retries
//
// GET calls are retried with exponential backoff on connection errors and on 502, 503 and
// 504; other calls are retried only when the connection could not be made at all (nothing
// was sent). WithRetries sets how many times.
package pal
