/**
 * `new Pal({ url, apiKey })` (or PAL_URL / PAL_API_KEY) and `client.runtime.*`: the REST API
 * of a Pal server over `fetch`. Works in Node >= 18 and in browsers; no runtime dependencies.
 */

import { Code, type CodeResult, type RunCodeOptions } from "./code.js";
import { PalConnectionError, PalError, errorFromResponse } from "./errors.js";
import { Processes } from "./processes.js";
import { SseParser } from "./sse.js";
import { Volumes } from "./volumes.js";
import { collect, pageQuery, paginate, type PageOptions, type VmListOptions } from "./pages.js";
import type {
  AgentSpec,
  Egress,
  ExecRequest,
  ExecResult,
  ExecStreamEvent,
  FileBytes,
  FileList,
  FileText,
  FileDeleted,
  FileWritten,
  ForkOptions,
  ForkResult,
  Image,
  JsonOf,
  KeptSnapshot,
  LifetimeUpdate,
  Method,
  PathWith,
  PortLink,
  PortLinkRevoked,
  SecretRotated,
  Snapshot,
  SnapshotState,
  Vm,
  VmEvent,
  VmMetrics,
} from "./types.js";

export const DEFAULT_URL = "http://127.0.0.1:8080";
const TRUNCATED_HEADER = "x-pal-truncated";

export interface PalOptions {
  /** Server URL; default PAL_URL, else http://127.0.0.1:8080. */
  url?: string;
  /** Tenant API key; default PAL_API_KEY. */
  apiKey?: string;
  /** Per-request timeout in ms for calls other than exec (default 120000; 0 = none). */
  timeoutMs?: number;
  /** A fetch implementation (default: the global one). */
  fetch?: typeof fetch;
}

export interface RequestOptions {
  /** Abort the call (for execStream: stops the command in the guest). */
  signal?: AbortSignal;
  /** execStream: called with the command's process id before its first output, so a
   * dropped stream can be read on with `runtime.processes.output(vmId, processId)`. */
  onProcess?: (processId: number) => void;
}

function env(name: string): string | undefined {
  // Node has process.env; a browser has neither (pass url/apiKey there).
  const proc = (globalThis as { process?: { env?: Record<string, string | undefined> } }).process;
  const value = proc?.env?.[name];
  return value === undefined || value === "" ? undefined : value;
}

type Query = Record<string, string | undefined>;
type Body = string | Uint8Array | ArrayBuffer | Blob;

interface Call {
  params?: Record<string, string>;
  query?: Query;
  json?: unknown;
  body?: Body;
  headers?: Record<string, string>;
  signal?: AbortSignal;
  timeout?: boolean;
}

export class Pal {
  readonly url: string;
  readonly runtime: Runtime;
  /** Volumes: create, list, get, delete, resize (volumes.ts; docs/volumes.md). */
  readonly volumes: Volumes;
  private readonly apiKey: string | undefined;
  private readonly timeoutMs: number;
  private readonly fetchImpl: typeof fetch;

  constructor(options: PalOptions = {}) {
    this.url = (options.url ?? env("PAL_URL") ?? DEFAULT_URL).replace(/\/+$/, "");
    this.apiKey = options.apiKey ?? env("PAL_API_KEY");
    this.timeoutMs = options.timeoutMs ?? 120_000;
    const f = options.fetch ?? globalThis.fetch;
    if (typeof f !== "function") throw new Error("no fetch available: pass options.fetch (Node >= 18 has one)");
    this.fetchImpl = f.bind(globalThis);
    this.runtime = new Runtime(this);
    this.volumes = new Volumes(this);
  }

  /** GET /healthz: `{ok, ...}` (ok is false when the server cannot schedule VMs). */
  async health(): Promise<{ ok: boolean; [k: string]: unknown }> {
    return (await this.json("get", "/healthz")) as { ok: boolean; [k: string]: unknown };
  }

  /** GET /v1/images: the images this tenant may schedule (`image` in a schedule request), all pages. */
  images(options: PageOptions = {}): Promise<Image[]> {
    return collect(this.iterImages(options));
  }

  /** The images, a page at a time: `for await (const image of pal.iterImages())`. */
  iterImages(options: PageOptions = {}): AsyncGenerator<Image> {
    return paginate(async (query) => {
      const page = await this.json("get", "/v1/images", { query });
      return { items: page.images, nextCursor: page.nextCursor };
    }, pageQuery(options));
  }

  /** @internal A typed JSON call: the path must exist in the API with this method. */
  async json<M extends Method, P extends PathWith<M>>(method: M, path: P, call: Call = {}): Promise<JsonOf<M, P>> {
    const resp = await this.request(method, path, call);
    return (await resp.json()) as JsonOf<M, P>;
  }

  /** @internal The raw response of a typed call (errors thrown as PalError subclasses). */
  async request<M extends Method, P extends PathWith<M>>(method: M, path: P, call: Call = {}): Promise<Response> {
    let url = String(path).replace(/\{(\w+)\}/g, (_, name: string) => {
      const value = call.params?.[name];
      if (value === undefined || value === "") throw new PalError(400, "INVALID_ARGUMENT", `${name} is required`);
      return encodeURIComponent(value);
    });
    const q = Object.entries(call.query ?? {}).filter((kv): kv is [string, string] => kv[1] !== undefined);
    if (q.length) url += "?" + new URLSearchParams(q).toString();
    return this.send(url, method.toUpperCase(), call, call.timeout !== false);
  }

  private async send(path: string, method: string, call: Call, useTimeout: boolean): Promise<Response> {
    const headers: Record<string, string> = { ...(call.headers ?? {}) };
    if (this.apiKey) headers["Authorization"] = `Bearer ${this.apiKey}`;
    let body: BodyInit | undefined;
    if (call.json !== undefined) {
      headers["Content-Type"] = "application/json";
      body = JSON.stringify(call.json);
    } else if (call.body !== undefined) {
      headers["Content-Type"] = headers["Content-Type"] ?? "application/octet-stream";
      body = call.body as BodyInit;
    }
    // Without a timeout (exec, streams) the caller's signal goes to fetch as it is, so it can
    // abort the body too. With one, an inner controller aborts on either until the answer.
    const timed = useTimeout && this.timeoutMs > 0;
    const controller = timed ? new AbortController() : undefined;
    const onAbort = () => controller?.abort(call.signal?.reason);
    if (controller && call.signal) {
      if (call.signal.aborted) controller.abort(call.signal.reason);
      else call.signal.addEventListener("abort", onAbort, { once: true });
    }
    const timer = controller
      ? setTimeout(() => controller.abort(new PalError(0, "TIMEOUT", `no answer in ${this.timeoutMs} ms`)), this.timeoutMs)
      : undefined;
    let resp: Response;
    try {
      const signal = controller ? controller.signal : call.signal;
      resp = await this.fetchImpl(this.url + path, { method, headers, body, signal });
    } catch (exc) {
      if (call.signal?.aborted) throw exc;
      const reason = controller?.signal.reason;
      if (reason instanceof PalError) throw reason;
      throw new PalConnectionError(0, "CONNECTION_ERROR", `cannot reach Pal at ${this.url}: ${String(exc)}`);
    } finally {
      if (timer !== undefined) clearTimeout(timer);
      call.signal?.removeEventListener("abort", onAbort);
    }
    if (!resp.ok) throw await errorFromResponse(resp);
    return resp;
  }
}

/** The /v1/runtime calls, as the spec's examples use them. */
export class Runtime {
  /** Processes that outlive their request: start, output (reattaching), stdin, signals,
   * terminals, wait (processes.ts). */
  readonly processes: Processes;
  /** Code contexts: run, createContext, listContexts, deleteContext, interrupt (code.ts). */
  readonly code: Code;

  constructor(private readonly client: Pal) {
    this.processes = new Processes(client);
    this.code = new Code(client);
  }

  /** Run a cell in the VM's stateful kernel (Python via Jupyter, or bash): see code.ts. */
  runCode(vmId: string, code: string, options: RunCodeOptions = {}): Promise<CodeResult> {
    return this.code.run(vmId, code, options);
  }

  /** Schedule a sandbox microVM (402 QuotaExceededError when the tenant is full). */
  schedule(spec: AgentSpec = {}): Promise<Vm> {
    return this.client.json("post", "/v1/runtime/schedule", { json: spec });
  }

  get(vmId: string): Promise<Vm> {
    return this.client.json("get", "/v1/runtime/vms/{vm_id}", { params: { vm_id: vmId } });
  }

  /** The tenant's VMs, all pages; `metadata`: only those carrying all these tags. */
  list(options: VmListOptions = {}): Promise<Vm[]> {
    return collect(this.iterVms(options));
  }

  /** The VMs a page at a time: `for await (const vm of runtime.iterVms({ metadata }))`. */
  iterVms(options: VmListOptions = {}): AsyncGenerator<Vm> {
    return paginate(async (query) => {
      const page = await this.client.json("get", "/v1/runtime/vms", { query });
      return { items: page.vms, nextCursor: page.nextCursor };
    }, pageQuery(options));
  }

  /** Set the VM's lifetime (`{ lifetimeSecs }`, from its schedule; 0: none) or extend it
   * (`{ extendSecs }`); `onLifetimeEnd`: `"pause"` or `"delete"`. Answers the VM. */
  setLifetime(vmId: string, update: LifetimeUpdate): Promise<Vm> {
    return this.client.json("put", "/v1/runtime/vms/{vm_id}/lifetime", { params: { vm_id: vmId }, json: update });
  }

  /** The VM's lifetime ends `secs` later. Answers the VM. */
  extendLifetime(vmId: string, secs: number): Promise<Vm> {
    return this.setLifetime(vmId, { extendSecs: secs });
  }

  /** Stop the VM (terminated); its snapshots are released. */
  delete(vmId: string): Promise<Vm> {
    return this.client.json("delete", "/v1/runtime/vms/{vm_id}", { params: { vm_id: vmId } });
  }

  /** Snapshot memory and disk, stop the VM, free its quota slot (default); or, with
   * `{ mode: "live" }`, stop its vCPUs in place (same QEMU, connections kept, slot kept),
   * `offload: true` also handing its RAM back to the host. */
  pause(vmId: string, options?: { mode?: "snapshot" | "live"; offload?: boolean }): Promise<SnapshotState> {
    const params = { params: { vm_id: vmId } };
    if (!options) return this.client.json("post", "/v1/runtime/vms/{vm_id}/pause", params);
    return this.client.json("post", "/v1/runtime/vms/{vm_id}/pause", { ...params, json: options });
  }

  /** Continue a paused VM under the same vmId: a live-paused one in place, a snapshot-paused
   * one restored (402 over quota, 409 not paused). */
  resume(vmId: string): Promise<SnapshotState> {
    return this.client.json("post", "/v1/runtime/vms/{vm_id}/resume", { params: { vm_id: vmId } });
  }

  /** Change the egress policy: `"none"`, `"open"`, `{ allow: [...] }` or `{ deny: [...] }`.
   * A running VM's next connection follows it at once and its open connections the new
   * policy refuses are reset; a paused VM takes it when it runs again. Answers the VM. */
  setEgress(vmId: string, egress: Egress): Promise<Vm> {
    return this.client.json("put", "/v1/runtime/vms/{vm_id}/egress", { params: { vm_id: vmId }, json: { egress } });
  }

  /**
   * N copy-on-write copies; each child is running or carries an `error`. `metadata`: each
   * child's tags instead of the source's; `secrets`: set over the source's.
   */
  fork(vmId: string, options: ForkOptions = { count: 1 }): Promise<ForkResult> {
    return this.client.json("post", "/v1/runtime/vms/{vm_id}/fork", { params: { vm_id: vmId }, json: options });
  }

  /** Run a command and wait for it: `{exitCode, stdout, stderr, processId, timedOut?, truncated?}`.
   * With `yieldAfterMs`, a command still running then answers `{processId, running: true,
   * stdout, stderr, next}` and runs on: read on with `processes.output(vmId, processId, next)`. */
  exec(vmId: string, request: ExecRequest, options: RequestOptions = {}): Promise<ExecResult> {
    return this.client.json("post", "/v1/runtime/vms/{vm_id}/exec", {
      params: { vm_id: vmId },
      json: request,
      signal: options.signal,
      timeout: false, // the server bounds it (timeoutSecs)
    });
  }

  /**
   * Run a command and iterate its events as they happen: `stdout` / `stderr` chunks, then
   * one `exit` (or `error`). Errors before the command starts (404, 409, 402...) are thrown
   * by the first step of the iteration. Leaving the loop early (or aborting `signal`)
   * closes the stream, which stops the command in the guest.
   */
  async *execStream(vmId: string, request: ExecRequest, options: RequestOptions = {}): AsyncGenerator<ExecStreamEvent> {
    // Our own controller: leaving the loop early aborts the request, which closes the
    // connection (cancelling the body alone may leave it open), so the server stops the command.
    const abort = new AbortController();
    const user = options.signal;
    const relay = () => abort.abort(user?.reason);
    if (user?.aborted) abort.abort(user.reason);
    else user?.addEventListener("abort", relay, { once: true });
    let finished = false;
    let resp: Response;
    try {
      resp = await this.client.request("post", "/v1/runtime/vms/{vm_id}/exec", {
        params: { vm_id: vmId },
        json: request,
        headers: { Accept: "text/event-stream" },
        signal: abort.signal,
        timeout: false,
      });
    } catch (exc) {
      user?.removeEventListener("abort", relay);
      throw exc;
    }
    if (!resp.body) throw new PalError(resp.status, "NO_BODY", "the exec stream has no body");
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    const parser = new SseParser();
    try {
      for (;;) {
        const { value, done } = await reader.read();
        const messages = done ? parser.feed(decoder.decode()).concat(parser.end()) : parser.feed(decoder.decode(value, { stream: true }));
        for (const m of messages) {
          if (m.event === "process") {
            options.onProcess?.(Number((JSON.parse(m.data) as { processId: number }).processId));
            continue;
          }
          const ev = toEvent(m.event, m.data);
          if (ev === null) continue;
          yield ev;
          if (ev.type === "exit" || ev.type === "error") {
            finished = true;
            return;
          }
        }
        if (done) return;
      }
    } finally {
      user?.removeEventListener("abort", relay);
      if (!finished) {
        abort.abort();
        await reader.cancel().catch(() => undefined);
      }
      reader.releaseLock();
    }
  }

  /** Entries of a directory under /workspace (default: /workspace itself). */
  listFiles(vmId: string, path = ""): Promise<FileList> {
    return this.client.json("get", "/v1/runtime/vms/{vm_id}/files", { params: { vm_id: vmId }, query: { path } });
  }

  /** A file under /workspace as UTF-8 text; `truncated` when the server cut it at 1 MiB. */
  async readFile(vmId: string, path: string): Promise<FileText> {
    const resp = await this.client.request("get", "/v1/runtime/vms/{vm_id}/files/content", {
      params: { vm_id: vmId },
      query: { path },
    });
    const bytes = new Uint8Array(await resp.arrayBuffer());
    return { content: new TextDecoder().decode(bytes), truncated: isTruncated(resp) };
  }

  /** A file under /workspace as raw bytes (any content); `truncated` past 1 MiB. */
  async readFileBytes(vmId: string, path: string): Promise<FileBytes> {
    const resp = await this.client.request("get", "/v1/runtime/vms/{vm_id}/files/content", {
      params: { vm_id: vmId },
      query: { path },
    });
    return { content: new Uint8Array(await resp.arrayBuffer()), truncated: isTruncated(resp) };
  }

  /** Write a file under /workspace: text (UTF-8) or bytes, at most 1 MiB (413 above). */
  writeFile(vmId: string, path: string, content: string | Uint8Array | ArrayBuffer | Blob): Promise<FileWritten> {
    const body = typeof content === "string" ? new TextEncoder().encode(content) : content;
    return this.client.json("put", "/v1/runtime/vms/{vm_id}/files/content", {
      params: { vm_id: vmId },
      query: { path },
      body,
    });
  }

  /** Remove a file or symlink under /workspace (not a directory). */
  deleteFile(vmId: string, path: string): Promise<FileDeleted> {
    return this.client.json("delete", "/v1/runtime/vms/{vm_id}/files/content", {
      params: { vm_id: vmId },
      query: { path },
    });
  }

  /** A brokered secret's new value; the VM's next request carries it (the guest, which holds
   * only the placeholder, is not touched). `applied` is `"now"` or `"next start"`. */
  rotateSecret(vmId: string, name: string, value: string): Promise<SecretRotated> {
    return this.client.json("put", "/v1/runtime/vms/{vm_id}/secrets/{name}", {
      params: { vm_id: vmId, name },
      json: { value },
    });
  }

  /** A signed link to the server on `port` in the VM (`{url, expiresAt, linkId}`) that opens
   * it without the API key until it expires (default one hour) or `revokePortUrl` revokes it;
   * bound to this VM and port. */
  portUrl(vmId: string, port: number, options: { expiresInSecs?: number } = {}): Promise<PortLink> {
    return this.client.json("post", "/v1/runtime/vms/{vm_id}/ports/{port}/url", {
      params: { vm_id: vmId, port: String(port) },
      json: { expiresInSecs: options.expiresInSecs ?? 3600 },
    });
  }

  /** Revoke a link `portUrl` made (its `linkId`): it opens nothing from now on. */
  revokePortUrl(vmId: string, linkId: string): Promise<PortLinkRevoked> {
    return this.client.json("delete", "/v1/runtime/vms/{vm_id}/port-links/{link_id}", {
      params: { vm_id: vmId, link_id: linkId },
    });
  }

  /** Status events and audits (auto_resume, lifetime_ended...), oldest first, all pages. */
  events(vmId: string, options: PageOptions = {}): Promise<VmEvent[]> {
    return collect(this.iterEvents(vmId, options));
  }

  /** The events a page at a time. */
  iterEvents(vmId: string, options: PageOptions = {}): AsyncGenerator<VmEvent> {
    return paginate(async (query) => {
      const page = await this.client.json("get", "/v1/runtime/vms/{vm_id}/events", { params: { vm_id: vmId }, query });
      return { items: page.events, nextCursor: page.nextCursor };
    }, pageQuery(options));
  }

  /** CPU, memory, disk and network samples of the last 15 minutes (one every 5 s). */
  metrics(vmId: string): Promise<VmMetrics> {
    return this.client.json("get", "/v1/runtime/vms/{vm_id}/metrics", { params: { vm_id: vmId } });
  }

  /** The VM's snapshots kept on its node, with the size of each artifact, all pages. */
  snapshots(vmId: string, options: PageOptions = {}): Promise<Snapshot[]> {
    return collect(this.iterSnapshots(vmId, options));
  }

  /** The snapshots a page at a time. */
  iterSnapshots(vmId: string, options: PageOptions = {}): AsyncGenerator<Snapshot> {
    return paginate(async (query) => {
      const page = await this.client.json("get", "/v1/runtime/vms/{vm_id}/snapshots", { params: { vm_id: vmId }, query });
      return { items: page.snapshots, nextCursor: page.nextCursor };
    }, pageQuery(options));
  }

  /** Keep a snapshot of the VM (by `name`): out of its retention, past its delete; VMs start from it. */
  keepSnapshot(vmId: string, name?: string): Promise<KeptSnapshot> {
    const json = name === undefined ? {} : { name };
    return this.client.json("post", "/v1/runtime/vms/{vm_id}/snapshots", { params: { vm_id: vmId }, json });
  }

  /** The tenant's kept snapshots, oldest first (of one VM, of one name or id), all pages. */
  keptSnapshots(options: PageOptions & { vmId?: string; name?: string } = {}): Promise<KeptSnapshot[]> {
    return collect(this.iterKeptSnapshots(options));
  }

  /** The kept snapshots a page at a time. */
  iterKeptSnapshots(options: PageOptions & { vmId?: string; name?: string } = {}): AsyncGenerator<KeptSnapshot> {
    const first = pageQuery(options);
    if (options.vmId !== undefined) first.vmId = options.vmId;
    if (options.name !== undefined) first.name = options.name;
    return paginate(async (query) => {
      const page = await this.client.json("get", "/v1/runtime/snapshots", { query });
      return { items: page.snapshots, nextCursor: page.nextCursor };
    }, first);
  }

  /** A kept snapshot, by id or name. */
  keptSnapshot(snapshot: string): Promise<KeptSnapshot> {
    return this.client.json("get", "/v1/runtime/snapshots/{snapshot}", { params: { snapshot } });
  }

  /** Let a kept snapshot go (by id or name); the VMs started from it run on. */
  deleteKeptSnapshot(snapshot: string): Promise<KeptSnapshot> {
    return this.client.json("delete", "/v1/runtime/snapshots/{snapshot}", { params: { snapshot } });
  }

  /**
   * `count` new VMs from a kept snapshot (its memory, disk and processes), as a fork answers.
   * `metadata`: each new VM's tags (a schedule's; `{}`: none) instead of the source's;
   * `secrets`: a schedule's, set over the source's in each new VM.
   */
  startFromSnapshot(
    snapshot: string,
    count = 1,
    options: Pick<ForkOptions, "metadata" | "secrets"> = {},
  ): Promise<ForkResult> {
    const json: ForkOptions = { count };
    if (options.metadata !== undefined) json.metadata = options.metadata;
    if (options.secrets !== undefined) json.secrets = options.secrets;
    return this.client.json("post", "/v1/runtime/snapshots/{snapshot}/start", { params: { snapshot }, json });
  }
}

function isTruncated(resp: Response): boolean {
  return (resp.headers.get(TRUNCATED_HEADER) ?? "").toLowerCase() === "true";
}

function toEvent(name: string, data: string): ExecStreamEvent | null {
  let payload: Record<string, unknown> = {};
  try {
    payload = data ? (JSON.parse(data) as Record<string, unknown>) : {};
  } catch {
    payload = { data };
  }
  switch (name) {
    case "stdout":
    case "stderr":
      return { type: name, data: String(payload.data ?? "") };
    case "exit": {
      const ev: ExecStreamEvent = { type: "exit", exitCode: Number(payload.exitCode ?? -1) };
      if (payload.timedOut) ev.timedOut = true;
      return ev;
    }
    case "error": {
      const code = String(payload.code ?? "ERROR");
      const message = String(payload.message ?? "");
      return { type: "error", code, message, data: `${code}: ${message}\n` };
    }
    default:
      return null; // an event kind this SDK does not know: skipped
  }
}
