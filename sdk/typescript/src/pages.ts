/**
 * Cursor pagination: a list call fetches a page (`limit`, `cursor`), yields its items and
 * follows `nextCursor` until it is null, so `for await (const vm of runtime.iterVms())`
 * walks a list of any length without seeing pages.
 */

/** Options of every paged list. */
export interface PageOptions {
  /** Items per request (default: the server's most, 1000). */
  pageSize?: number;
}

/** Options of the VM list. */
export interface VmListOptions extends PageOptions {
  /** Only VMs carrying all these metadata tags. */
  metadata?: Record<string, string>;
}

export type PageQuery = Record<string, string | undefined>;

/** The first page's query: `limit` and the `metadata.k=v` filters. */
export function pageQuery(options: VmListOptions = {}): PageQuery {
  const q: PageQuery = {};
  for (const [k, v] of Object.entries(options.metadata ?? {})) q[`metadata.${k}`] = v;
  if (options.pageSize !== undefined) q.limit = String(options.pageSize);
  return q;
}

/** Every item over all pages; `fetchPage` gets each page's query. */
export async function* paginate<T>(
  fetchPage: (query: PageQuery) => Promise<{ items: T[]; nextCursor?: string | null }>,
  first: PageQuery,
): AsyncGenerator<T> {
  const query = { ...first };
  for (;;) {
    const page = await fetchPage(query);
    yield* page.items;
    if (!page.nextCursor) return;
    query.cursor = page.nextCursor;
  }
}

/** All items of an async iterable, in order. */
export async function collect<T>(items: AsyncIterable<T>): Promise<T[]> {
  const out: T[] = [];
  for await (const item of items) out.push(item);
  return out;
}
