/// <reference types="node" />
// A cursor file for Node (and Electron): written so that a crash at any moment leaves either
// the old cursor or the new one, never a torn or empty file. The bytes go to a temporary file
// in the same directory (a rename is only atomic within one file system), which is flushed to
// disk, renamed over the cursor file, and then the directory is flushed so the rename itself
// survives a power cut.

import { mkdir, open, readFile, rename, unlink } from "node:fs/promises";
import { dirname } from "node:path";

import type { CursorStore } from "./stores.js";

export interface FileCursorStoreOptions {
  /** Flush the file and its directory to disk on every write (default true). */
  fsync?: boolean;
}

let sequence = 0;

export function fileCursorStore(path: string, options: FileCursorStoreOptions = {}): CursorStore {
  const fsync = options.fsync ?? true;
  const directory = dirname(path);
  return {
    async get() {
      try {
        const text = (await readFile(path, "utf8")).trim();
        return text === "" ? null : text;
      } catch (error) {
        if ((error as NodeJS.ErrnoException).code === "ENOENT") return null;
        throw error;
      }
    },
    async set(cursor: string) {
      // A name of its own per write: two stores on one path (a mistake, but possible) must not
      // rename each other's half-written file.
      const temporary = `${path}.${process.pid}.${++sequence}.tmp`;
      await mkdir(directory, { recursive: true });
      const file = await open(temporary, "w", 0o600);
      try {
        await file.writeFile(cursor, "utf8");
        if (fsync) await file.sync();
      } catch (error) {
        await file.close();
        await unlink(temporary).catch(() => {});
        throw error;
      }
      await file.close();
      try {
        await rename(temporary, path);
      } catch (error) {
        await unlink(temporary).catch(() => {});
        throw error;
      }
      if (fsync) {
        const dir = await open(directory, "r");
        try {
          await dir.sync();
        } finally {
          await dir.close();
        }
      }
    },
  };
}
