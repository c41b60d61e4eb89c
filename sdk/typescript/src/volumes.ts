/**
 * `pal.volumes`: volumes, storage that outlives a VM (docs/volumes.md). A volume is named by
 * its id or its name.
 */

import type { Pal } from "./client.js";
import { collect, pageQuery, paginate, type VmListOptions } from "./pages.js";
import type {
  FileBytes,
  FileDeleted,
  FileText,
  FileWritten,
  Volume,
  VolumeCreate,
  VolumeDir,
  VolumeEntry,
  VolumeFileList,
} from "./types.js";

const TRUNCATED_HEADER = "X-Pal-Truncated";

export class Volumes {
  constructor(private readonly client: Pal) {}

  /** A new volume (`sizeMib`: its limit, 1 GiB unless given; allocated as written). 409 for a
   * name the tenant has, 402 past its volume quota. */
  create(spec: VolumeCreate): Promise<Volume> {
    return this.client.json("post", "/v1/volumes", { json: spec });
  }

  /** The tenant's volumes, oldest first, all pages; `metadata`: only those with all these tags. */
  list(options: VmListOptions = {}): Promise<Volume[]> {
    return collect(this.iter(options));
  }

  /** The volumes a page at a time: `for await (const v of pal.volumes.iter())`. */
  iter(options: VmListOptions = {}): AsyncGenerator<Volume> {
    return paginate(async (query) => {
      const page = await this.client.json("get", "/v1/volumes", { query });
      return { items: page.volumes, nextCursor: page.nextCursor };
    }, pageQuery(options));
  }

  /** The volume (by id or name), with `mountedBy`: the VMs that mount it. */
  get(volume: string): Promise<Volume> {
    return this.client.json("get", "/v1/volumes/{volume}", { params: { volume } });
  }

  /** Delete it and its files; refused (409 ConflictError) while VMs mount it, unless `force`. */
  delete(volume: string, options: { force?: boolean } = {}): Promise<Volume> {
    const query = options.force ? { force: "true" } : {};
    return this.client.json("delete", "/v1/volumes/{volume}", { params: { volume }, query });
  }

  /** Grow it to `sizeMib` (a smaller size is a 400). */
  resize(volume: string, sizeMib: number): Promise<Volume> {
    return this.client.json("post", "/v1/volumes/{volume}/resize", { params: { volume }, json: { sizeMib } });
  }

  // -- its files, without a sandbox (the shapes of a VM's files API) ---------------------

  /** A directory of the volume (default: its root), `depth` levels down (1 unless given):
   * `{path, entries: [{name, type, size, path, mode, uid, gid, modifiedAt, target?}], truncated}`. */
  listFiles(volume: string, path = "", options: { depth?: number } = {}): Promise<VolumeFileList> {
    const query = options.depth === undefined ? { path } : { path, depth: String(options.depth) };
    return this.client.json("get", "/v1/volumes/{volume}/files", { params: { volume }, query });
  }

  /** What is at `path` (a symlink is not followed); NotFoundError (FILE_NOT_FOUND) for nothing. */
  stat(volume: string, path: string): Promise<VolumeEntry> {
    return this.client.json("get", "/v1/volumes/{volume}/files/stat", { params: { volume }, query: { path } });
  }

  /** Whether anything is at `path` (an error for a volume that is not there). */
  async exists(volume: string, path: string): Promise<boolean> {
    try {
      await this.stat(volume, path);
      return true;
    } catch (err) {
      if ((err as { code?: string }).code === "FILE_NOT_FOUND") return false;
      throw err;
    }
  }

  /** A file of the volume as UTF-8 text; `truncated` when the server cut it at 1 MiB. */
  async readFile(volume: string, path: string): Promise<FileText> {
    const bytes = await this.readFileBytes(volume, path);
    return { content: new TextDecoder().decode(bytes.content), truncated: bytes.truncated };
  }

  /** A file of the volume as raw bytes; `truncated` past 1 MiB. */
  async readFileBytes(volume: string, path: string): Promise<FileBytes> {
    const resp = await this.client.request("get", "/v1/volumes/{volume}/files/content", {
      params: { volume },
      query: { path },
    });
    const truncated = (resp.headers.get(TRUNCATED_HEADER) ?? "").toLowerCase() === "true";
    return { content: new Uint8Array(await resp.arrayBuffer()), truncated };
  }

  /** Create or replace a file (parents made), text (UTF-8) or bytes, at most 1 MiB (413);
   * 507 past the volume's size. */
  writeFile(volume: string, path: string, content: string | Uint8Array | ArrayBuffer | Blob): Promise<FileWritten> {
    const body = typeof content === "string" ? new TextEncoder().encode(content) : content;
    return this.client.json("put", "/v1/volumes/{volume}/files/content", { params: { volume }, query: { path }, body });
  }

  /** Make a directory; `parents`: its missing parents too, and no error if it is there. */
  makeDir(volume: string, path: string, options: { parents?: boolean } = {}): Promise<VolumeDir> {
    const query = options.parents ? { path, parents: "true" } : { path };
    return this.client.json("post", "/v1/volumes/{volume}/files/dir", { params: { volume }, query });
  }

  /** Remove a file or symlink; a directory with `recursive`. */
  deleteFile(volume: string, path: string, options: { recursive?: boolean } = {}): Promise<FileDeleted> {
    const query = options.recursive ? { path, recursive: "true" } : { path };
    return this.client.json("delete", "/v1/volumes/{volume}/files/content", { params: { volume }, query });
  }
}
