// posthorn-client: the browser and Node client of a posthorn hub's device event stream.

export {
  connect,
  type ConnectOptions,
  type ConnectionState,
  type FinalState,
  type Finished,
  type PosthornEvent,
  type ResyncReason,
  type StateInfo,
  type Subscription,
  type TokenSource,
} from "./client.js";
export { type Clock, systemClock } from "./clock.js";
export { type ErrorCode, PosthornError } from "./errors.js";
export { EventStreamParser, type Parsed, type ParsedEvent, type ParsedRetry } from "./parser.js";
export {
  CAP_MS,
  DEFAULT_RETRY_MS,
  FLOOR_MS,
  HEALTHY_AFTER_MS,
  ReconnectPolicy,
  parseRetryAfter,
} from "./policy.js";
export { type CursorStore, type StorageLike, localStorageCursorStore, memoryCursorStore } from "./stores.js";
export { ACK_INTERVAL_MS } from "./ack.js";
