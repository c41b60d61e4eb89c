/**
 * A small incremental text/event-stream parser (the only one this SDK needs, so no
 * dependency): feed it decoded text as it arrives, get complete events back.
 */

export interface SseMessage {
  event: string;
  data: string;
  /** The event's `id:` field, when it has one (a process output's journal offset). */
  id?: string;
}

export class SseParser {
  private buffer = "";
  private event = "message";
  private data: string[] = [];
  private id: string | undefined;

  /** Parse a chunk; returns the events completed by it. */
  feed(chunk: string): SseMessage[] {
    this.buffer += chunk;
    const out: SseMessage[] = [];
    for (;;) {
      const nl = this.buffer.search(/\r\n|\r|\n/);
      if (nl < 0) break;
      const sep = this.buffer.startsWith("\r\n", nl) ? 2 : 1;
      const line = this.buffer.slice(0, nl);
      this.buffer = this.buffer.slice(nl + sep);
      const msg = this.line(line);
      if (msg) out.push(msg);
    }
    return out;
  }

  /** Call at the end of the stream: an event not yet terminated by a blank line. */
  end(): SseMessage[] {
    const rest = this.buffer;
    this.buffer = "";
    const out = rest ? this.feed(rest + "\n") : [];
    const last = this.line("");
    if (last) out.push(last);
    return out;
  }

  private line(line: string): SseMessage | null {
    if (line === "") {
      if (this.data.length === 0) {
        this.event = "message";
        this.id = undefined;
        return null;
      }
      const msg: SseMessage = { event: this.event, data: this.data.join("\n") };
      if (this.id !== undefined) msg.id = this.id;
      this.event = "message";
      this.data = [];
      this.id = undefined;
      return msg;
    }
    if (line.startsWith(":")) return null; // a comment (keepalive)
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "event") this.event = value;
    else if (field === "data") this.data.push(value);
    else if (field === "id") this.id = value;
    return null;
  }
}
