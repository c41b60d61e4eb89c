package pal

import (
	"net/url"
	"strings"
)

// route is one REST operation of the server. Every request the SDK makes goes through one
// of the values below (Client.do takes a route, never a bare path), so this table is the
// whole list of routes the SDK calls: tests/unit/test_sdk_drift.py reads it and checks it
// against the server's OpenAPI document. Keep it one `route{"METHOD", "/path"}` per line.
type route struct {
	method string
	path   string // an OpenAPI path template: {name} for each parameter, in order
}

var (
	routeHealth       = route{"GET", "/healthz"}
	routeImages       = route{"GET", "/v1/images"}
	routeSchedule     = route{"POST", "/v1/runtime/schedule"}
	routeListVMs      = route{"GET", "/v1/runtime/vms"}
	routeGetVM        = route{"GET", "/v1/runtime/vms/{vm_id}"}
	routeDeleteVM     = route{"DELETE", "/v1/runtime/vms/{vm_id}"}
	routeSetEgress    = route{"PUT", "/v1/runtime/vms/{vm_id}/egress"}
	routeRotateSecret = route{"PUT", "/v1/runtime/vms/{vm_id}/secrets/{name}"}
	routeSetLifetime  = route{"PUT", "/v1/runtime/vms/{vm_id}/lifetime"}
	routePause        = route{"POST", "/v1/runtime/vms/{vm_id}/pause"}
	routeResume       = route{"POST", "/v1/runtime/vms/{vm_id}/resume"}
	routeFork         = route{"POST", "/v1/runtime/vms/{vm_id}/fork"}
	routeExec         = route{"POST", "/v1/runtime/vms/{vm_id}/exec"}
	routeListFiles    = route{"GET", "/v1/runtime/vms/{vm_id}/files"}
	routeReadFile     = route{"GET", "/v1/runtime/vms/{vm_id}/files/content"}
	routeWriteFile    = route{"PUT", "/v1/runtime/vms/{vm_id}/files/content"}
	routeDeleteFile   = route{"DELETE", "/v1/runtime/vms/{vm_id}/files/content"}
	routeEvents       = route{"GET", "/v1/runtime/vms/{vm_id}/events"}
	routeMetrics      = route{"GET", "/v1/runtime/vms/{vm_id}/metrics"}
	routeSnapshots    = route{"GET", "/v1/runtime/vms/{vm_id}/snapshots"}
	// kept_snapshots.go
	routeKeepSnapshot  = route{"POST", "/v1/runtime/vms/{vm_id}/snapshots"}
	routeKeptSnapshots = route{"GET", "/v1/runtime/snapshots"}
	routeKeptSnapshot  = route{"GET", "/v1/runtime/snapshots/{snapshot}"}
	routeDeleteKept    = route{"DELETE", "/v1/runtime/snapshots/{snapshot}"}
	routeStartFromKept = route{"POST", "/v1/runtime/snapshots/{snapshot}/start"}
	routePortURL       = route{"POST", "/v1/runtime/vms/{vm_id}/ports/{port}/url"}
	routeRevokeLink    = route{"DELETE", "/v1/runtime/vms/{vm_id}/port-links/{link_id}"}
	// processes.go, process_stream.go
	routeStartProcess  = route{"POST", "/v1/runtime/vms/{vm_id}/processes"}
	routeListProcesses = route{"GET", "/v1/runtime/vms/{vm_id}/processes"}
	routeGetProcess    = route{"GET", "/v1/runtime/vms/{vm_id}/processes/{pid}"}
	routeKillProcess   = route{"DELETE", "/v1/runtime/vms/{vm_id}/processes/{pid}"}
	routeProcessOutput = route{"GET", "/v1/runtime/vms/{vm_id}/processes/{pid}/output"}
	routeWriteStdin    = route{"POST", "/v1/runtime/vms/{vm_id}/processes/{pid}/stdin"}
	routeCloseStdin    = route{"POST", "/v1/runtime/vms/{vm_id}/processes/{pid}/stdin/close"}
	routeSignalProcess = route{"POST", "/v1/runtime/vms/{vm_id}/processes/{pid}/signal"}
	routeResizeProcess = route{"POST", "/v1/runtime/vms/{vm_id}/processes/{pid}/resize"}
	routeProcessStats  = route{"GET", "/v1/runtime/vms/{vm_id}/processes/{pid}/stats"}
	routeWaitProcess   = route{"POST", "/v1/runtime/vms/{vm_id}/processes/{pid}/wait"}
	routeAttachURL     = route{"POST", "/v1/runtime/vms/{vm_id}/processes/{pid}/attach-url"}

	// code.go
	routeRunCode      = route{"POST", "/v1/runtime/vms/{vm_id}/code"}
	routeNewContext   = route{"POST", "/v1/runtime/vms/{vm_id}/code/contexts"}
	routeListContexts = route{"GET", "/v1/runtime/vms/{vm_id}/code/contexts"}
	routeDelContext   = route{"DELETE", "/v1/runtime/vms/{vm_id}/code/contexts/{ctx}"}
	routeInterrupt    = route{"POST", "/v1/runtime/vms/{vm_id}/code/contexts/{ctx}/interrupt"}

	// volumes.go
	routeCreateVolume = route{"POST", "/v1/volumes"}
	routeListVolumes  = route{"GET", "/v1/volumes"}
	routeGetVolume    = route{"GET", "/v1/volumes/{volume}"}
	routeDeleteVolume = route{"DELETE", "/v1/volumes/{volume}"}
	routeResizeVolume = route{"POST", "/v1/volumes/{volume}/resize"}
	routeVolumeFiles  = route{"GET", "/v1/volumes/{volume}/files"}
	routeVolumeStat   = route{"GET", "/v1/volumes/{volume}/files/stat"}
	routeVolumeRead   = route{"GET", "/v1/volumes/{volume}/files/content"}
	routeVolumeWrite  = route{"PUT", "/v1/volumes/{volume}/files/content"}
	routeVolumeMkdir  = route{"POST", "/v1/volumes/{volume}/files/dir"}
	routeVolumeRemove = route{"DELETE", "/v1/volumes/{volume}/files/content"}
)

// expand fills the template's parameters in order, each escaped as one path segment. An
// empty parameter is refused (it would name another route).
func (r route) expand(params ...string) (string, error) {
	var b strings.Builder
	rest := r.path
	for _, p := range params {
		open := strings.IndexByte(rest, '{')
		end := strings.IndexByte(rest, '}')
		if open < 0 || end < open {
			return "", &APIError{Status: 400, Code: "INVALID_ARGUMENT", Message: "too many path parameters for " + r.path}
		}
		if p == "" {
			return "", &APIError{Status: 400, Code: "INVALID_ARGUMENT", Message: rest[open+1:end] + " is required"}
		}
		b.WriteString(rest[:open])
		b.WriteString(url.PathEscape(p))
		rest = rest[end+1:]
	}
	if strings.IndexByte(rest, '{') >= 0 {
		return "", &APIError{Status: 400, Code: "INVALID_ARGUMENT", Message: "missing path parameters for " + r.path}
	}
	b.WriteString(rest)
	return b.String(), nil
}
