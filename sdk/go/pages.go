package pal

import (
	"context"
	"net/url"
	"strconv"
)

// ListOption narrows or pages a list call (List, Events, Snapshots, Images.List and their
// Iter forms). The list calls follow the server's pages themselves.
type ListOption func(*listParams)

type listParams struct {
	metadata map[string]string
	pageSize int
}

// WithMetadata keeps only the VMs tagged key=value (List, IterVMs); several of them must
// all match.
func WithMetadata(key, value string) ListOption {
	return func(p *listParams) {
		if p.metadata == nil {
			p.metadata = map[string]string{}
		}
		p.metadata[key] = value
	}
}

// WithPageSize sets how many items each request asks for (default: the server's most,
// 1000). The iteration is the same whatever the size.
func WithPageSize(n int) ListOption {
	return func(p *listParams) { p.pageSize = n }
}

func listQuery(opts []ListOption) url.Values {
	var p listParams
	for _, o := range opts {
		o(&p)
	}
	q := url.Values{}
	for k, v := range p.metadata {
		q.Set("metadata."+k, v)
	}
	if p.pageSize > 0 {
		q.Set("limit", strconv.Itoa(p.pageSize))
	}
	return q
}

// Pager walks a paged list item by item, fetching the next page when one runs out:
//
//	it := client.Runtime.IterVMs(pal.WithMetadata("run", "42"))
//	for it.Next(ctx) {
//		vm := it.Item()
//	}
//	if err := it.Err(); err != nil { ... }
type Pager[T any] struct {
	fetch  func(ctx context.Context, q url.Values) ([]T, string, error)
	query  url.Values
	buf    []T
	item   T
	done   bool
	err    error
	cursor string
	begun  bool
}

func newPager[T any](query url.Values, fetch func(ctx context.Context, q url.Values) ([]T, string, error)) *Pager[T] {
	return &Pager[T]{fetch: fetch, query: query}
}

// Next moves to the next item, fetching a page when needed; false at the end or on an
// error (Err tells which).
func (p *Pager[T]) Next(ctx context.Context) bool {
	for len(p.buf) == 0 {
		if p.err != nil || (p.begun && p.cursor == "") {
			return false
		}
		q := url.Values{}
		for k, v := range p.query {
			q[k] = v
		}
		if p.cursor != "" {
			q.Set("cursor", p.cursor)
		}
		items, next, err := p.fetch(ctx, q)
		if err != nil {
			p.err = err
			return false
		}
		p.buf, p.cursor, p.begun = items, next, true
	}
	p.item, p.buf = p.buf[0], p.buf[1:]
	return true
}

// Item is the current item (after Next answered true).
func (p *Pager[T]) Item() T { return p.item }

// Err is the error that ended the iteration, or nil.
func (p *Pager[T]) Err() error { return p.err }

// All collects the remaining items of every page.
func (p *Pager[T]) All(ctx context.Context) ([]T, error) {
	out := []T{}
	for p.Next(ctx) {
		out = append(out, p.Item())
	}
	return out, p.Err()
}

// IterVMs walks the tenant's VMs a page at a time (WithMetadata filters).
func (r *RuntimeService) IterVMs(opts ...ListOption) *Pager[VM] {
	return newPager(listQuery(opts), func(ctx context.Context, q url.Values) ([]VM, string, error) {
		var out struct {
			VMs        []VM    `json:"vms"`
			NextCursor *string `json:"nextCursor"`
		}
		err := r.c.doJSON(ctx, call{route: routeListVMs, query: q}, &out)
		return out.VMs, deref(out.NextCursor), err
	})
}

// IterEvents walks a VM's events, oldest first, a page at a time.
func (r *RuntimeService) IterEvents(vmID string, opts ...ListOption) *Pager[Event] {
	return newPager(listQuery(opts), func(ctx context.Context, q url.Values) ([]Event, string, error) {
		var out struct {
			Events     []Event `json:"events"`
			NextCursor *string `json:"nextCursor"`
		}
		err := r.c.doJSON(ctx, call{route: routeEvents, params: []string{vmID}, query: q}, &out)
		return out.Events, deref(out.NextCursor), err
	})
}

// IterSnapshots walks a VM's snapshots a page at a time.
func (r *RuntimeService) IterSnapshots(vmID string, opts ...ListOption) *Pager[Snapshot] {
	return newPager(listQuery(opts), func(ctx context.Context, q url.Values) ([]Snapshot, string, error) {
		var out struct {
			Snapshots  []Snapshot `json:"snapshots"`
			NextCursor *string    `json:"nextCursor"`
		}
		err := r.c.doJSON(ctx, call{route: routeSnapshots, params: []string{vmID}, query: q}, &out)
		return out.Snapshots, deref(out.NextCursor), err
	})
}

// Iter walks the images a page at a time.
func (s *ImagesService) Iter(opts ...ListOption) *Pager[Image] {
	return newPager(listQuery(opts), func(ctx context.Context, q url.Values) ([]Image, string, error) {
		var out struct {
			Images     []Image `json:"images"`
			NextCursor *string `json:"nextCursor"`
		}
		err := s.c.doJSON(ctx, call{route: routeImages, query: q}, &out)
		return out.Images, deref(out.NextCursor), err
	})
}

// SetLifetime sets or extends a VM's lifetime (LifetimeUpdate) and returns the VM.
func (r *RuntimeService) SetLifetime(ctx context.Context, vmID string, update LifetimeUpdate) (*VM, error) {
	var out VM
	return &out, r.c.doJSON(ctx, call{route: routeSetLifetime, params: []string{vmID}, json: update}, &out)
}

// ExtendLifetime makes a VM's lifetime end secs later (a VM without one gets one ending
// secs from now) and returns the VM.
func (r *RuntimeService) ExtendLifetime(ctx context.Context, vmID string, secs int) (*VM, error) {
	return r.SetLifetime(ctx, vmID, LifetimeUpdate{ExtendSecs: secs})
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}
