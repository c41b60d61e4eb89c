/**
 * `client.runtime.processes`: processes that outlive their request (docs/processes.md):
 * start one in the background, read its output from any offset, write its stdin, signal,
 * resize its terminal, wait for its exit.
 *
 * `output()` follows a process's output and reattaches by itself from the last offset it
 * gave (after a dropped connection, or a `detached` event: the VM paused, moved, its node
 * restarted), so the caller sees every byte once, in order, and then the exit. A reattach
 * wakes an idle-suspended VM as an exec does; a VM paused by an operator (409) is waited
 * for, up to `reattachTimeoutMs`.
 */

import { ConflictError, PalConnectionError, PalError, ServerError } from "./errors.js";
import type { Pal } from "./client.js";
import { SseParser } from "./sse.js";
import type { components } from "./openapi.js";

type Schemas = components["schemas"];

/** A process: `{processId, osPid, argv, tag, running, exitCode, timedOut, journal, ...}`. */
export type Process = Schemas["ProcessInfo"];
/** A start request: `{command, argv, env, cwd, user, timeoutSecs, stdin, pty, tag, keepAwake, journalBytes}`. */
export type ProcessStart = Schemas["ProcessStartRequest"];
export type ProcessDeleted = Schemas["ProcessDeleted"];
/** A stdin write's answer: `written` bytes taken, `closed` when stdin is closed now. */
export type StdinWritten = Schemas["StdinWritten"];
export type Signaled = Schemas["SignalOut"];
export type Resized = Schemas["ResizeOut"];
export type ProcessStats = Schemas["ProcessStatsOut"];
/** A signal for `signal()`: sent to the process's whole group. */
export type SignalName = Schemas["SignalRequest"]["signal"];

/** One read of `read()`: bytes lost to the journal's bound (`gap`), then the output;
 * `next` is where the next read starts. */
export interface ProcessRead {
  from: number;
  next: number;
  gap: number;
  output: { stream: "stdout" | "stderr"; data: Uint8Array }[];
  process: Process;
}

/** One event of `output()`: `stdout`/`stderr` bytes with the journal `offset` after them,
 * `gap` (`lost` bytes dropped by the journal's bound, `offset` after them), then one `exit`. */
export type OutputEvent =
  | { type: "stdout"; data: Uint8Array; offset: number }
  | { type: "stderr"; data: Uint8Array; offset: number }
  | { type: "gap"; lost: number; offset: number }
  | { type: "exit"; exitCode: number | null; timedOut: boolean };

export interface OutputOptions {
  /** Stop following (the process runs on). */
  signal?: AbortSignal;
  /** How long to keep trying to reattach while the stream cannot be opened (default 300000). */
  reattachTimeoutMs?: number;
}

export const REATTACH_TIMEOUT_MS = 300_000;
const BACKOFF_START_MS = 200;
const BACKOFF_MAX_MS = 2_000;
const WAIT_POLL_SECS = 60; // the server's longest wait; a longer one is several polls
const STDIN_CHUNK = 1 << 20; // the server's bound on one stdin write

/** A stream event that says the stream ended while the process may run on: reattach. */
class Detached extends Error {}

export class Processes {
  constructor(private readonly client: Pal) {}

  /** Start `command` (execve-style: `argv` are its arguments) in the background; with
   * `stdin: true` its stdin stays open for `sendStdin`, with `pty: {cols, rows}` it runs on a
   * terminal (see `terminal()`). Answers the process (`processId`). */
  async start(vmId: string, request: ProcessStart): Promise<Process> {
    const body: ProcessStart = { ...request, argv: request.argv ?? [] };
    const resp = await this.client.request("post", "/v1/runtime/vms/{vm_id}/processes", {
      params: { vm_id: vmId },
      json: body,
    });
    return (await resp.json()) as Process;
  }

  /** Start `command` on a terminal of `cols` x `rows` and get a handle to type into it,
   * resize it and read it. */
  async terminal(vmId: string, request: Omit<ProcessStart, "pty" | "stdin"> & { cols?: number; rows?: number }): Promise<Terminal> {
    const { cols = 80, rows = 24, ...rest } = request;
    const proc = await this.start(vmId, { ...rest, pty: { cols, rows } });
    return new Terminal(this, vmId, proc);
  }

  /** The VM's processes, running and recently exited (with their exit codes). */
  async list(vmId: string): Promise<Process[]> {
    return (await this.client.json("get", "/v1/runtime/vms/{vm_id}/processes", { params: { vm_id: vmId } })).processes;
  }

  get(vmId: string, pid: number): Promise<Process> {
    return this.client.json("get", "/v1/runtime/vms/{vm_id}/processes/{pid}", { params: params(vmId, pid) });
  }

  /** One read from `offset` (a poll); `waitMs` (<= 60000) waits for output past it. */
  async read(vmId: string, pid: number, offset = 0, options: { waitMs?: number } = {}): Promise<ProcessRead> {
    const body = await this.client.json("get", "/v1/runtime/vms/{vm_id}/processes/{pid}/output", {
      params: params(vmId, pid),
      query: { from: String(offset), waitMs: String(options.waitMs ?? 0), encoding: "base64" },
      timeout: false, // the server bounds the wait
    });
    return { ...body, output: body.output.map((o) => ({ stream: o.stream, data: fromBase64(o.data) })) };
  }

  /**
   * The output from `offset` on as it comes, ending with the `exit` event. Reattaches by
   * itself from the last offset it gave after a dropped connection or a `detached` event,
   * so no byte is lost or repeated. Leaving the loop (or aborting `signal`) stops reading;
   * the process runs on.
   */
  async *output(vmId: string, pid: number, offset = 0, options: OutputOptions = {}): AsyncGenerator<OutputEvent> {
    const limit = options.reattachTimeoutMs ?? REATTACH_TIMEOUT_MS;
    let backoff = BACKOFF_START_MS;
    let since = Date.now();
    for (;;) {
      let moved = false;
      try {
        for await (const ev of this.attach(vmId, pid, offset, options.signal)) {
          moved = true;
          backoff = BACKOFF_START_MS;
          since = Date.now();
          if (ev.type !== "exit") offset = ev.offset;
          yield ev;
          if (ev.type === "exit") return;
        }
        throw new Detached("the stream ended without an exit");
      } catch (exc) {
        if (options.signal?.aborted) throw exc;
        if (!(exc instanceof Detached) && (!mayReattach(exc) || Date.now() - since > limit)) throw exc;
        if (!moved || !(exc instanceof Detached)) {
          // nothing came: wait a little before the next attach (the VM may be pausing)
          await sleep(backoff, options.signal);
          backoff = Math.min(backoff * 2, BACKOFF_MAX_MS);
        }
      }
    }
  }

  /** One attach: the events until the stream ends; `Detached` when it ends without an exit. */
  private async *attach(vmId: string, pid: number, offset: number, user?: AbortSignal): AsyncGenerator<OutputEvent> {
    const abort = new AbortController();
    const relay = () => abort.abort(user?.reason);
    if (user?.aborted) abort.abort(user.reason);
    else user?.addEventListener("abort", relay, { once: true });
    try {
      const resp = await this.client.request("get", "/v1/runtime/vms/{vm_id}/processes/{pid}/output", {
        params: params(vmId, pid),
        query: { from: String(offset), encoding: "base64" },
        headers: { Accept: "text/event-stream" },
        signal: abort.signal,
        timeout: false,
      });
      if (!resp.body) throw new PalConnectionError(0, "NO_BODY", "the output stream has no body");
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      const parser = new SseParser();
      try {
        for (;;) {
          let chunk: ReadableStreamReadResult<Uint8Array>;
          try {
            chunk = await reader.read();
          } catch (exc) {
            if (user?.aborted) throw exc;
            throw new PalConnectionError(0, "CONNECTION_ERROR", `the output stream broke: ${String(exc)}`);
          }
          const text = chunk.done ? decoder.decode() : decoder.decode(chunk.value, { stream: true });
          const messages = chunk.done ? parser.feed(text).concat(parser.end()) : parser.feed(text);
          for (const m of messages) {
            const ev = toOutputEvent(m.event, m.id, m.data);
            if (ev !== null) yield ev;
            if (ev?.type === "exit") return;
          }
          if (chunk.done) throw new Detached("the stream ended");
        }
      } finally {
        abort.abort();
        await reader.cancel().catch(() => undefined);
      }
    } finally {
      user?.removeEventListener("abort", relay);
    }
  }

  /** Write all of `data` (a string as UTF-8) to its stdin; `eof` closes it after. The server
   * takes at most 1 MiB a call and may take less (a process not reading): the rest is sent
   * again. */
  async sendStdin(vmId: string, pid: number, data: string | Uint8Array, options: { eof?: boolean } = {}): Promise<void> {
    let rest = typeof data === "string" ? new TextEncoder().encode(data) : data;
    for (;;) {
      const part = rest.subarray(0, STDIN_CHUNK);
      const last = part.length === rest.length;
      const res = await this.client.json("post", "/v1/runtime/vms/{vm_id}/processes/{pid}/stdin", {
        params: params(vmId, pid),
        query: { eof: options.eof && last ? "true" : "false" },
        body: part,
      });
      rest = rest.subarray(res.written);
      if (rest.length === 0) return;
    }
  }

  /** Close its stdin (a terminal gets ^D). */
  closeStdin(vmId: string, pid: number): Promise<StdinWritten> {
    return this.client.json("post", "/v1/runtime/vms/{vm_id}/processes/{pid}/stdin/close", { params: params(vmId, pid) });
  }

  /** Send a signal to its whole process group (default INT). */
  signal(vmId: string, pid: number, signal: SignalName = "INT"): Promise<Signaled> {
    return this.client.json("post", "/v1/runtime/vms/{vm_id}/processes/{pid}/signal", {
      params: params(vmId, pid),
      json: { signal },
    });
  }

  /** Its CPU time, resident memory, threads and state now, from the guest's /proc (null figures once it ended). */
  stats(vmId: string, pid: number): Promise<ProcessStats> {
    return this.client.json("get", "/v1/runtime/vms/{vm_id}/processes/{pid}/stats", { params: params(vmId, pid) });
  }

  /** Its terminal's new size (the program gets SIGWINCH); 409 for a process without one. */
  resize(vmId: string, pid: number, cols: number, rows: number): Promise<Resized> {
    return this.client.json("post", "/v1/runtime/vms/{vm_id}/processes/{pid}/resize", {
      params: params(vmId, pid),
      json: { cols, rows },
    });
  }

  /** A signed link (`{url, expiresAt, linkId}`) that opens the process's WebSocket attach
   * without the API key, for a browser's terminal (docs/processes.md, "WebSocket attach"). */
  attachUrl(vmId: string, pid: number, expiresInSecs = 300) {
    return this.client.json("post", "/v1/runtime/vms/{vm_id}/processes/{pid}/attach-url", {
      params: params(vmId, pid),
      json: { expiresInSecs },
    });
  }

  /** Kill it (its group) and forget it. */
  kill(vmId: string, pid: number): Promise<ProcessDeleted> {
    return this.client.json("delete", "/v1/runtime/vms/{vm_id}/processes/{pid}", { params: params(vmId, pid) });
  }

  /** The process once it exited, or as it is after `timeoutSecs` (default: no limit; a
   * longer wait is several long polls of the server's). */
  async wait(vmId: string, pid: number, options: { timeoutSecs?: number } = {}): Promise<Process> {
    const deadline = options.timeoutSecs === undefined ? undefined : Date.now() + options.timeoutSecs * 1000;
    for (;;) {
      const left = deadline === undefined ? WAIT_POLL_SECS : Math.max(0, (deadline - Date.now()) / 1000);
      const proc = await this.client.json("post", "/v1/runtime/vms/{vm_id}/processes/{pid}/wait", {
        params: params(vmId, pid),
        query: { timeoutSecs: String(Math.min(left, WAIT_POLL_SECS)) },
        timeout: false, // the server bounds the wait
      });
      if (!proc.running || (deadline !== undefined && Date.now() >= deadline)) return proc;
    }
  }
}

/** A process on a terminal (`processes.terminal()`): type into it, resize it, read it. */
export class Terminal {
  constructor(
    private readonly processes: Processes,
    readonly vmId: string,
    readonly process: Process,
  ) {}

  get pid(): number {
    return this.process.processId;
  }

  /** Type: text (UTF-8) or bytes, as keys reach the terminal ("\x03" is ^C). */
  write(data: string | Uint8Array): Promise<void> {
    return this.processes.sendStdin(this.vmId, this.pid, data);
  }

  resize(cols: number, rows: number): Promise<Resized> {
    return this.processes.resize(this.vmId, this.pid, cols, rows);
  }

  /** What the terminal shows, as it comes (one stream: `stdout`), from `offset`. */
  output(offset = 0, options: OutputOptions = {}): AsyncGenerator<OutputEvent> {
    return this.processes.output(this.vmId, this.pid, offset, options);
  }

  wait(options: { timeoutSecs?: number } = {}): Promise<Process> {
    return this.processes.wait(this.vmId, this.pid, options);
  }

  kill(): Promise<ProcessDeleted> {
    return this.processes.kill(this.vmId, this.pid);
  }
}

function params(vmId: string, pid: number): Record<string, string> {
  return { vm_id: vmId, pid: String(pid) };
}

/** A stream that could not be (re)opened for a while: the VM is paused (409, until it is
 * resumed), the server or its node is away (a connection error, 502/503/504). */
function mayReattach(exc: unknown): boolean {
  if (exc instanceof ConflictError || exc instanceof PalConnectionError) return true;
  return exc instanceof ServerError && [502, 503, 504].includes(exc.status);
}

function fromBase64(data: string): Uint8Array {
  const bin = atob(data);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const timer = setTimeout(done, ms);
    function done() {
      signal?.removeEventListener("abort", abort);
      resolve();
    }
    function abort() {
      clearTimeout(timer);
      reject(signal?.reason);
    }
    signal?.addEventListener("abort", abort, { once: true });
  });
}

/** One SSE event of `/output?encoding=base64` (null: a kind this SDK does not know). */
function toOutputEvent(name: string, id: string | undefined, data: string): OutputEvent | null {
  let body: Record<string, unknown>;
  try {
    body = data ? (JSON.parse(data) as Record<string, unknown>) : {};
  } catch {
    return null;
  }
  const offset = Number(id ?? 0);
  switch (name) {
    case "stdout":
    case "stderr":
      return { type: name, data: fromBase64(String(body.data ?? "")), offset };
    case "gap":
      return { type: "gap", lost: Number(body.lost ?? 0), offset };
    case "exit":
      return { type: "exit", exitCode: body.exitCode == null ? null : Number(body.exitCode), timedOut: Boolean(body.timedOut) };
    case "detached":
      throw new Detached(String(body.reason ?? "detached"));
    case "error":
      throw new PalError(503, "STREAM_ERROR", `${String(body.code)}: ${String(body.message)}`);
    default:
      return null;
  }
}
