// Where the cursor lives between connections and between runs of the application. Any object
// with `get` and `set` (synchronous or returning promises) is a store; two are built in here,
// and a file store for Node is in `posthorn-client/file-store` (kept apart so that a browser
// bundle never imports `node:fs`).

export interface CursorStore {
  /** The stored cursor, or `null`/`undefined`/`""` when there is none. Called once, at connect. */
  get(): string | null | undefined | Promise<string | null | undefined>;
  /** Replaces the stored cursor. The client waits for the returned promise before it acks. */
  set(cursor: string): void | Promise<void>;
}

/** The part of the Web Storage API the store uses (`localStorage`, `sessionStorage`, a fake). */
export interface StorageLike {
  getItem(key: string): string | null;
  setItem(key: string, value: string): void;
}

/**
 * A cursor kept in `localStorage` under `key`, so a page reload resumes where the last page left
 * off. Give each device its own key if one page follows several devices.
 */
export function localStorageCursorStore(
  key = "posthorn-cursor",
  storage: StorageLike | undefined = (globalThis as { localStorage?: StorageLike }).localStorage,
): CursorStore {
  if (storage === undefined) {
    throw new TypeError("localStorageCursorStore: no localStorage here; pass a storage object");
  }
  return {
    get: () => storage.getItem(key),
    set: (cursor) => storage.setItem(key, cursor),
  };
}

/** A cursor kept in memory only: reconnects within one run lose nothing, a restart does. */
export function memoryCursorStore(initial: string | null = null): CursorStore & { value: string | null } {
  const store = {
    value: initial,
    get: () => store.value,
    set: (cursor: string) => {
      store.value = cursor;
    },
  };
  return store;
}
