// What went wrong, as one error type with a stable `code` an application can switch on; the
// message is for people and may change.

export type ErrorCode =
  /** The request could not be sent or the stream broke (DNS, refused, reset, EOF mid-body). */
  | "network"
  /** Nothing arrived for three heartbeat intervals: the connection is presumed dead. */
  | "dead"
  /** The hub (or a proxy) answered with a status worth retrying (503, 502, ...). */
  | "status"
  /** A 200 whose body is not an event stream (a captive portal, a misrouted proxy). */
  | "content_type"
  /** 401: the token was refused. */
  | "unauthorized"
  /** The device's tokens were revoked: `event: revoked`, or 401 `token_revoked`. */
  | "revoked"
  /** 400, 403 or 404: the URL, device id or token's device is wrong; retrying cannot help. */
  | "refused"
  /** The token callback threw or returned something that is not a usable token. */
  | "token"
  /** `onEvent` or `onResync` threw: the cursor did not move, the event comes again. */
  | "callback"
  /** The cursor store could not be read or written. */
  | "cursor_store"
  /** An ack failed; the next one covers it. */
  | "ack";

export class PosthornError extends Error {
  readonly code: ErrorCode;
  /** The HTTP status, when an answer caused the error. */
  readonly status: number | undefined;
  /** The answer's body (at most 4 KiB), when an answer caused the error. */
  readonly body: string | undefined;

  constructor(
    code: ErrorCode,
    message: string,
    details: { status?: number; body?: string; cause?: unknown } = {},
  ) {
    super(message, details.cause === undefined ? undefined : { cause: details.cause });
    this.name = "PosthornError";
    this.code = code;
    this.status = details.status;
    this.body = details.body;
  }
}
