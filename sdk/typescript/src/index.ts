export { DEFAULT_URL, Pal, Runtime } from "./client.js";
export { Code } from "./code.js";
export type { CodeContext, CodeOutput, CodeResult, RunCodeOptions } from "./code.js";
export type { PalOptions, RequestOptions } from "./client.js";
export {
  AuthenticationError,
  BadRequestError,
  ConflictError,
  NotFoundError,
  PalConnectionError,
  PalError,
  PayloadTooLargeError,
  PermissionDeniedError,
  QuotaExceededError,
  ServerError,
} from "./errors.js";
export { Processes, REATTACH_TIMEOUT_MS, Terminal } from "./processes.js";
export type {
  OutputEvent,
  OutputOptions,
  Process,
  ProcessDeleted,
  ProcessRead,
  ProcessStart,
  Resized,
  SignalName,
  Signaled,
  StdinWritten,
} from "./processes.js";
export { SseParser } from "./sse.js";
export { Volumes } from "./volumes.js";
export type { PageOptions, VmListOptions } from "./pages.js";
export type { SseMessage } from "./sse.js";
export type {
  AgentSpec,
  Egress,
  ExecRequest,
  ExecResult,
  ExecStreamEvent,
  FileBytes,
  FileDeleted,
  FileEntry,
  FileList,
  FileText,
  FileWritten,
  ForkChild,
  ForkOptions,
  ForkResult,
  Image,
  KeptSnapshot,
  LifetimeUpdate,
  Limits,
  LimitsApplied,
  MetricSample,
  PortLink,
  PortLinkRevoked,
  SecretRotated,
  Snapshot,
  SnapshotState,
  Vm,
  VmEvent,
  VmMetrics,
  Volume,
  VolumeCreate,
  VolumeDir,
  VolumeEntry,
  VolumeFileList,
} from "./types.js";
