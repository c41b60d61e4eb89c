/**
 * Errors the SDK throws: one class per API status, all carrying `status`, `code`,
 * `message` and `requestId` from the server's `{"error": {"code", "message", "requestId"}}` body.
 */

export class PalError extends Error {
  /** HTTP status (0: no answer at all). */
  readonly status: number;
  /** The server's error code, e.g. `QUOTA_EXCEEDED`, `FAILED_PRECONDITION`, `PATH_ESCAPE`. */
  readonly code: string;
  /** The request's id (its X-Request-Id): the server's log has the details under it. */
  readonly requestId: string | undefined;

  constructor(status: number, code: string, message: string, requestId?: string) {
    super(message);
    this.name = new.target.name;
    this.status = status;
    this.code = code;
    this.requestId = requestId;
  }
}

/** The server could not be reached (wrong URL, server down, network error). */
export class PalConnectionError extends PalError {}
/** 400: invalid request (bad argument, path escaping /workspace, missing executable...). */
export class BadRequestError extends PalError {}
/** 401: missing or invalid API key. */
export class AuthenticationError extends PalError {}
/** 402: the tenant's quota of running VMs is exhausted. */
export class QuotaExceededError extends PalError {}
/** 403: not allowed. */
export class PermissionDeniedError extends PalError {}
/** 404: unknown VM (or another tenant's). */
export class NotFoundError extends PalError {}
/** 409: the VM is in the wrong lifecycle state for this call. */
export class ConflictError extends PalError {}
/** 413: file content over 1 MiB. */
export class PayloadTooLargeError extends PalError {}
/** 5xx: the server or its backend could not do it. */
export class ServerError extends PalError {}

const BY_STATUS: Record<
  number,
  new (status: number, code: string, message: string, requestId?: string) => PalError
> = {
  400: BadRequestError,
  401: AuthenticationError,
  402: QuotaExceededError,
  403: PermissionDeniedError,
  404: NotFoundError,
  409: ConflictError,
  413: PayloadTooLargeError,
};

export function errorFor(status: number, code: string, message: string, requestId?: string): PalError {
  const cls = BY_STATUS[status] ?? (status >= 500 ? ServerError : PalError);
  return new cls(status, code, message, requestId);
}

/** The error for a non-2xx response (reads its body). */
export async function errorFromResponse(resp: Response): Promise<PalError> {
  const text = await resp.text().catch(() => "");
  try {
    const body = JSON.parse(text) as { error?: { code?: unknown; message?: unknown; requestId?: unknown } };
    if (body && typeof body.error === "object" && body.error !== null) {
      const rid = body.error.requestId;
      return errorFor(
        resp.status,
        String(body.error.code ?? "ERROR"),
        String(body.error.message ?? ""),
        typeof rid === "string" ? rid : (resp.headers.get("x-request-id") ?? undefined),
      );
    }
  } catch {
    // not JSON: fall through
  }
  return errorFor(resp.status, "HTTP_ERROR", text.slice(0, 500) || `HTTP ${resp.status}`);
}
