/**
 * `pal.volumes`: volumes, storage that outlives a VM (docs/volumes.md). A volume is named by
 * its id or its name.
 */

import type { Pal } from "./client.js";
import { collect, pageQuery, paginate, type VmListOptions } from "./pages.js";
import type { Volume, VolumeCreate } from "./types.js";

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
}
