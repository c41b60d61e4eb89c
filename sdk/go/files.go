package pal

import (
	"context"
	"io"
	"net/url"
	"strings"
)

// Files live under the VM's /workspace: paths are relative to it (a path leaving it is
// ErrBadRequest) and are accessed as the workload user. Contents are bytes, at most 1 MiB.

// ListFiles lists a directory under /workspace ("" or "." for /workspace itself).
func (r *RuntimeService) ListFiles(ctx context.Context, vmID, path string) (*FileList, error) {
	var out FileList
	k := call{route: routeListFiles, params: []string{vmID}, query: url.Values{"path": {path}}}
	return &out, r.c.doJSON(ctx, k, &out)
}

// ReadFile returns a file's bytes, exactly as stored. A file larger than the server sends
// (1 MiB) returns its beginning together with ErrTruncated.
func (r *RuntimeService) ReadFile(ctx context.Context, vmID, path string) ([]byte, error) {
	k := call{route: routeReadFile, params: []string{vmID}, query: url.Values{"path": {path}}}
	resp, cancel, err := r.c.do(ctx, k)
	if err != nil {
		return nil, err
	}
	defer cancel()
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, wrapTransport(err, r.c.baseURL)
	}
	if strings.EqualFold(resp.Header.Get(truncatedHdr), "true") {
		return data, ErrTruncated
	}
	return data, nil
}

// WriteFile creates or replaces a file (parents are made as needed) with data, at most
// 1 MiB (ErrTooLarge above).
func (r *RuntimeService) WriteFile(ctx context.Context, vmID, path string, data []byte) (*FileWritten, error) {
	if data == nil {
		data = []byte{}
	}
	k := call{route: routeWriteFile, params: []string{vmID}, query: url.Values{"path": {path}}, body: data, hasBody: true}
	var out FileWritten
	return &out, r.c.doJSON(ctx, k, &out)
}

// DeleteFile removes a file or symlink (not a directory).
func (r *RuntimeService) DeleteFile(ctx context.Context, vmID, path string) (*FileDeleted, error) {
	k := call{route: routeDeleteFile, params: []string{vmID}, query: url.Values{"path": {path}}}
	var out FileDeleted
	return &out, r.c.doJSON(ctx, k, &out)
}
