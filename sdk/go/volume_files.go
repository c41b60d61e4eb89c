package pal

import (
	"context"
	"errors"
	"io"
	"net/url"
	"strconv"
	"strings"
)

// VolumeEntry is one file of a volume as the server sees it (a symlink is not followed).
type VolumeEntry struct {
	Name       string  `json:"name"`
	Type       string  `json:"type"` // "file", "dir", "symlink", "other"
	Size       int64   `json:"size"`
	Path       string  `json:"path"` // from the volume's root
	Mode       int     `json:"mode"` // the permission bits
	UID        int     `json:"uid"`
	GID        int     `json:"gid"`
	ModifiedAt string  `json:"modifiedAt"`
	Target     *string `json:"target,omitempty"` // a symlink's target
}

// VolumeFileList is a directory of a volume.
type VolumeFileList struct {
	Path      string        `json:"path"`
	Entries   []VolumeEntry `json:"entries"`
	Truncated bool          `json:"truncated"`
}

// VolumeDir answers MakeDir: Created is false when it was there (parents).
type VolumeDir struct {
	Path    string `json:"path"`
	Created bool   `json:"created"`
}

func pathQuery(path string) url.Values { return url.Values{"path": {path}} }

// ListFiles lists a directory of a volume, depth levels down (0: the server's default, 1).
func (s *VolumesService) ListFiles(ctx context.Context, volume, path string, depth int) (*VolumeFileList, error) {
	q := pathQuery(path)
	if depth > 0 {
		q.Set("depth", strconv.Itoa(depth))
	}
	var out VolumeFileList
	return &out, s.c.doJSON(ctx, call{route: routeVolumeFiles, params: []string{volume}, query: q}, &out)
}

// Stat returns what is at path (ErrNotFound, code FILE_NOT_FOUND, when nothing is).
func (s *VolumesService) Stat(ctx context.Context, volume, path string) (*VolumeEntry, error) {
	var out VolumeEntry
	return &out, s.c.doJSON(ctx, call{route: routeVolumeStat, params: []string{volume}, query: pathQuery(path)}, &out)
}

// Exists says whether something is at path (an error for a volume that is not there).
func (s *VolumesService) Exists(ctx context.Context, volume, path string) (bool, error) {
	_, err := s.Stat(ctx, volume, path)
	var apiErr *APIError
	if errors.As(err, &apiErr) && apiErr.Code == "FILE_NOT_FOUND" {
		return false, nil
	}
	return err == nil, err
}

// ReadFile returns a file's bytes; past 1 MiB its beginning together with ErrTruncated.
func (s *VolumesService) ReadFile(ctx context.Context, volume, path string) ([]byte, error) {
	resp, cancel, err := s.c.do(ctx, call{route: routeVolumeRead, params: []string{volume}, query: pathQuery(path)})
	if err != nil {
		return nil, err
	}
	defer cancel()
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, wrapTransport(err, s.c.baseURL)
	}
	if strings.EqualFold(resp.Header.Get(truncatedHdr), "true") {
		return data, ErrTruncated
	}
	return data, nil
}

// WriteFile creates or replaces a file of a volume (parents made), at most 1 MiB.
func (s *VolumesService) WriteFile(ctx context.Context, volume, path string, data []byte) (*FileWritten, error) {
	if data == nil {
		data = []byte{}
	}
	k := call{route: routeVolumeWrite, params: []string{volume}, query: pathQuery(path), body: data, hasBody: true}
	var out FileWritten
	return &out, s.c.doJSON(ctx, k, &out)
}

// MakeDir makes a directory of a volume; parents: its missing parents too (mkdir -p).
func (s *VolumesService) MakeDir(ctx context.Context, volume, path string, parents bool) (*VolumeDir, error) {
	q := pathQuery(path)
	if parents {
		q.Set("parents", "true")
	}
	var out VolumeDir
	return &out, s.c.doJSON(ctx, call{route: routeVolumeMkdir, params: []string{volume}, query: q}, &out)
}

// DeleteFile removes a file or symlink of a volume; a directory with recursive.
func (s *VolumesService) DeleteFile(ctx context.Context, volume, path string, recursive bool) (*FileDeleted, error) {
	q := pathQuery(path)
	if recursive {
		q.Set("recursive", "true")
	}
	var out FileDeleted
	return &out, s.c.doJSON(ctx, call{route: routeVolumeRemove, params: []string{volume}, query: q}, &out)
}
