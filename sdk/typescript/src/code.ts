/**
 * The code interpreter (docs/agents.md "Code interpreter"): `runtime.runCode(vm, code)` runs
 * a cell in the VM's stateful kernel (Python via Jupyter, or bash); `runtime.code` manages
 * contexts. Results are MIME bundles; `png` comes decoded as bytes.
 */

import type { Pal } from "./client.js";
import type { components } from "./openapi.js";

type Schemas = components["schemas"];

export type CodeContext = Schemas["CodeContext"];
export type CodeResultBody = Schemas["CodeResult"];

export interface RunCodeOptions {
  /** `python` (default) or `bash`. */
  language?: "python" | "bash";
  /** A context id (default: the language's default context, started on first use). */
  context?: string;
  /** Interrupt the cell after this long (the context stays usable). */
  timeoutSecs?: number;
  signal?: AbortSignal;
}

/** One display result: its MIME bundle, with the usual types at hand. */
export interface CodeOutput {
  data: Record<string, unknown>;
  isMainResult: boolean;
  text?: string;
  html?: string;
  /** image/png, decoded. */
  png?: Uint8Array;
  svg?: string;
  json?: unknown;
}

export interface CodeResult {
  contextId: string;
  executionCount: number | null;
  stdout: string;
  stderr: string;
  /** The last expression's text/plain, or null. */
  text: string | null;
  error: { name: string; value: string; traceback: string[] } | null;
  timedOut: boolean;
  results: CodeOutput[];
}

function decodeBase64(b64: string): Uint8Array {
  const bin = atob(b64);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

function output(raw: Record<string, unknown>): CodeOutput {
  const { isMainResult, ...data } = raw;
  const str = (k: string) => (typeof data[k] === "string" ? (data[k] as string) : undefined);
  const png = str("image/png");
  return {
    data,
    isMainResult: isMainResult === true,
    text: str("text/plain"),
    html: str("text/html"),
    png: png === undefined ? undefined : decodeBase64(png),
    svg: str("image/svg+xml"),
    json: data["application/json"],
  };
}

/** `runtime.code`: cells and contexts of a VM's kernels. */
export class Code {
  constructor(private readonly client: Pal) {}

  /** Run one cell; variables persist in its context between cells. */
  async run(vmId: string, code: string, options: RunCodeOptions = {}): Promise<CodeResult> {
    const json: Schemas["CodeRequest"] = { code, language: options.language ?? "python" };
    if (options.context !== undefined) json.contextId = options.context;
    if (options.timeoutSecs !== undefined) json.timeoutSecs = options.timeoutSecs;
    const body = await this.client.json("post", "/v1/runtime/vms/{vm_id}/code", {
      params: { vm_id: vmId },
      json,
      signal: options.signal,
      timeout: false, // the server bounds it (timeoutSecs)
    });
    return {
      contextId: body.contextId,
      executionCount: body.executionCount ?? null,
      stdout: body.stdout,
      stderr: body.stderr,
      text: body.text ?? null,
      error: body.error ?? null,
      timedOut: body.timedOut ?? false,
      results: body.results.map((r) => output(r as Record<string, unknown>)),
    };
  }

  /** Start a context of its own (a separate kernel), with an optional cwd and env. */
  async createContext(
    vmId: string,
    options: { language?: "python" | "bash"; cwd?: string; env?: Record<string, string> } = {},
  ): Promise<CodeContext> {
    const resp = await this.client.request("post", "/v1/runtime/vms/{vm_id}/code/contexts", {
      params: { vm_id: vmId },
      json: { language: options.language ?? "python", cwd: options.cwd ?? null, env: options.env ?? {} },
      timeout: false, // a kernel start may take a while
    });
    return (await resp.json()) as CodeContext;
  }

  async listContexts(vmId: string): Promise<CodeContext[]> {
    return (await this.client.json("get", "/v1/runtime/vms/{vm_id}/code/contexts", { params: { vm_id: vmId } }))
      .contexts;
  }

  deleteContext(vmId: string, context: string): Promise<Schemas["ContextDeleted"]> {
    return this.client.json("delete", "/v1/runtime/vms/{vm_id}/code/contexts/{ctx}", {
      params: { vm_id: vmId, ctx: context },
    });
  }

  /** Interrupt the cell running in a context (`interrupted: false` when none ran). */
  interrupt(vmId: string, context: string): Promise<Schemas["ContextInterrupted"]> {
    return this.client.json("post", "/v1/runtime/vms/{vm_id}/code/contexts/{ctx}/interrupt", {
      params: { vm_id: vmId, ctx: context },
    });
  }
}
