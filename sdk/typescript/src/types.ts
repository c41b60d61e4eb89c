/**
 * The SDK's types, taken from the server's OpenAPI document (openapi.ts is generated from
 * it by `npm run gen:types`), so they cannot drift from the API: a changed route or shape
 * changes these types and the SDK no longer compiles until it follows.
 */

import type { components, paths } from "./openapi.js";

type Schemas = components["schemas"];

export type Limits = Schemas["Limits"];
/** The schedule request: image, limits, secrets, idleTimeoutSecs, boot... (all optional). */
export type AgentSpec = Schemas["AgentSpec"];
export type Vm = Schemas["VmOut"];
/** The host limits a VM's node applied when it last came up (`applied`), and why each `skipped` one is missing. */
export type LimitsApplied = Schemas["LimitsAppliedOut"];
/** An egress policy: `"none"`, `"open"`, `{ allow: [hosts] }` or `{ deny: [hosts] }`. */
export type Egress = Schemas["EgressUpdate"]["egress"];
/** Answer of pause and resume: `{vmId, snapshotId, state}`, and `pause` (its kind) when paused. */
export type SnapshotState = Schemas["SnapshotStateOut"];
export type ForkOptions = Schemas["ForkRequest"];
export type ForkResult = Schemas["ForkOut"];
export type ForkChild = Schemas["ForkChildOut"];
/** Exec is execve-style: `command` is the executable, `argv` its arguments. */
export type ExecRequest = Schemas["ExecRequest"];
export type ExecResult = Schemas["ExecOut"];
export type FileList = Schemas["FileListOut"];
export type FileEntry = Schemas["FileEntryOut"];
export type FileWritten = Schemas["FileWrittenOut"];
export type FileDeleted = Schemas["FileDeletedOut"];
/** A signed port link: `{url, expiresAt, linkId}` (expiresAt in Unix seconds). */
export type PortLink = Schemas["PortUrlOut"];
export type PortLinkRevoked = Schemas["PortLinkRevokedOut"];
export type SecretRotated = Schemas["SecretRotatedOut"];
export type VmEvent = Schemas["EventOut"];
export type VmMetrics = Schemas["VmMetricsOut"];
export type MetricSample = Schemas["MetricSampleOut"];
export type Snapshot = Schemas["SnapshotOut"];
/** A kept snapshot: `{snapshotId, name?, sourceVmId, createdAt}` (docs/lifecycle.md, "Kept snapshots"). */
export type KeptSnapshot = Schemas["KeptSnapshotOut"];
export type Image = Schemas["ImageOut"];
/** A volume: `{volumeId, name, sizeMib, state, metadata, createdAt, updatedAt, mountedBy?}`. */
export type Volume = Schemas["VolumeOut"];
/** POST /v1/volumes: `{ name, sizeMib?, metadata? }`. */
export type VolumeCreate = Schemas["VolumeCreate"];
/** A directory of a volume: `{path, entries, truncated}`. */
export type VolumeFileList = Schemas["VolumeFileListOut"];
/** One file of a volume: `{name, type, size, path, mode, uid, gid, modifiedAt, target?}`. */
export type VolumeEntry = Schemas["VolumeEntryOut"];
/** A volume's `makeDir`: `{path, created}`. */
export type VolumeDir = Schemas["VolumeDirOut"];
/** PUT .../lifetime: `{ lifetimeSecs }` (from the schedule; 0: none) or `{ extendSecs }`, and `onLifetimeEnd`. */
export type LifetimeUpdate = Schemas["LifetimeUpdate"];

/** One event of `execStream`, in the order the command produced them. Every event but
 * `exit` has `data`, a text to show: the output for `stdout`/`stderr`; for `error` (the
 * command could not run or was cut off; the stream ends with it) the error in words,
 * `"CODE: message\n"`, beside its `code` and `message`. So a loop that prints `ev.data` for
 * everything but `exit` (the spec's example) shows an error too. */
export type ExecStreamEvent =
  | { type: "stdout"; data: string }
  | { type: "stderr"; data: string }
  | { type: "exit"; exitCode: number; timedOut?: boolean }
  | { type: "error"; code: string; message: string; data: string };

/** `readFile`: the text (UTF-8) and whether the server cut it at 1 MiB. */
export interface FileText {
  content: string;
  truncated: boolean;
}

/** `readFileBytes`: the raw bytes and whether the server cut them at 1 MiB. */
export interface FileBytes {
  content: Uint8Array;
  truncated: boolean;
}

// -- typed routes (internal) -----------------------------------------------------------------

export type Method = "get" | "post" | "put" | "delete";

/** The API paths that have method M. */
export type PathWith<M extends Method> = {
  [P in keyof paths]: [NonNullable<paths[P][M]>] extends [never] ? never : P;
}[keyof paths];

type Operation<M extends Method, P extends PathWith<M>> = NonNullable<paths[P][M]>;

/** The JSON body of the 200 answer of `M P`. */
export type JsonOf<M extends Method, P extends PathWith<M>> =
  Operation<M, P> extends { responses: { 200: { content: { "application/json": infer T } } } } ? T : never;
