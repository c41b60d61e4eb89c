package pal

import (
	"context"
	"net/url"
)

// VolumesService holds the /v1/volumes calls (Client.Volumes): volumes, storage that
// outlives a VM (docs/volumes.md). A volume is named by its id or its name.
type VolumesService struct {
	c *Client
}

// Volume is a volume as the server describes it.
type Volume struct {
	VolumeID  string            `json:"volumeId"`
	Name      string            `json:"name"`
	SizeMib   int               `json:"sizeMib"`
	State     string            `json:"state"` // creating, ready, deleting; deleted in a delete's answer
	Metadata  map[string]string `json:"metadata"`
	CreatedAt string            `json:"createdAt"`
	UpdatedAt string            `json:"updatedAt"`
	MountedBy []string          `json:"mountedBy,omitempty"` // Get: the VMs that mount it
}

// VolumeSpec is a new volume: SizeMib 0 means the server's default (1 GiB).
type VolumeSpec struct {
	Name     string            `json:"name"`
	SizeMib  int               `json:"sizeMib,omitempty"`
	Metadata map[string]string `json:"metadata,omitempty"`
}

// Create makes a volume (ErrConflict for a name the tenant has, ErrQuota past its volume quota).
func (s *VolumesService) Create(ctx context.Context, spec VolumeSpec) (*Volume, error) {
	var out Volume
	return &out, s.c.doJSON(ctx, call{route: routeCreateVolume, json: spec}, &out)
}

// List returns the tenant's volumes, oldest first, every page (WithMetadata filters).
func (s *VolumesService) List(ctx context.Context, opts ...ListOption) ([]Volume, error) {
	return s.Iter(opts...).All(ctx)
}

// Iter walks the volumes a page at a time.
func (s *VolumesService) Iter(opts ...ListOption) *Pager[Volume] {
	return newPager(listQuery(opts), func(ctx context.Context, q url.Values) ([]Volume, string, error) {
		var out struct {
			Volumes    []Volume `json:"volumes"`
			NextCursor *string  `json:"nextCursor"`
		}
		err := s.c.doJSON(ctx, call{route: routeListVolumes, query: q}, &out)
		return out.Volumes, deref(out.NextCursor), err
	})
}

// Get returns a volume by id or name, with the VMs that mount it (ErrNotFound for another tenant's).
func (s *VolumesService) Get(ctx context.Context, volume string) (*Volume, error) {
	var out Volume
	return &out, s.c.doJSON(ctx, call{route: routeGetVolume, params: []string{volume}}, &out)
}

// Delete deletes a volume and its files; refused (ErrConflict) while VMs mount it unless force.
func (s *VolumesService) Delete(ctx context.Context, volume string, force bool) (*Volume, error) {
	k := call{route: routeDeleteVolume, params: []string{volume}}
	if force {
		k.query = url.Values{"force": {"true"}}
	}
	var out Volume
	return &out, s.c.doJSON(ctx, k, &out)
}

// Resize grows a volume to sizeMib (a smaller size is a 400).
func (s *VolumesService) Resize(ctx context.Context, volume string, sizeMib int) (*Volume, error) {
	body := map[string]int{"sizeMib": sizeMib}
	var out Volume
	return &out, s.c.doJSON(ctx, call{route: routeResizeVolume, params: []string{volume}, json: body}, &out)
}
