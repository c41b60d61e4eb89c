// The process calls' client-side rules against a local HTTP server on loopback (no Pal
// server needed): the output iterator reattaches from its last offset after a detached
// event, a dropped connection and a 409, and stops on an error event; stdin is resent from
// what the server took. Run by `node --test test/` after `npm run build`.

import assert from "node:assert/strict";
import { createServer } from "node:http";
import { after, before, describe, test } from "node:test";

import { NotFoundError, Pal, PalError } from "../dist/index.js";

const b64 = (s) => Buffer.from(s).toString("base64");
const sse = (lines) => lines.join("\n") + "\n\n";

describe("processes (local server)", () => {
  let server;
  let client;
  let handler = () => {};

  before(async () => {
    server = createServer((req, res) => handler(req, res));
    await new Promise((resolve) => server.listen(0, "127.0.0.1", resolve));
    client = new Pal({ url: `http://127.0.0.1:${server.address().port}`, apiKey: "pal_test" });
  });

  after(() => new Promise((resolve) => server.close(resolve)));

  test("output reattaches from its last offset after detached, a dropped connection and a 409", async () => {
    const froms = [];
    handler = (req, res) => {
      const url = new URL(req.url, "http://x");
      assert.equal(url.pathname, "/v1/runtime/vms/vm-1/processes/7/output");
      assert.equal(req.headers.accept, "text/event-stream");
      froms.push(url.searchParams.get("from"));
      const n = froms.length;
      if (n === 3) {
        res.writeHead(409, { "content-type": "application/json" });
        res.end(JSON.stringify({ error: { code: "FAILED_PRECONDITION", message: "paused", requestId: "r" } }));
        return;
      }
      res.writeHead(200, { "content-type": "text/event-stream" });
      if (n === 1) {
        res.write(sse(["id: 3", "event: stdout", `data: {"data":"${b64("abc")}"}`]));
        res.write(sse(["id: 5", "event: stderr", `data: {"data":"${b64("de")}"}`]));
        res.end(sse(["event: detached", 'data: {"reason":"vm-stopped"}']));
      } else if (n === 2) {
        res.write(sse(["id: 6", "event: stdout", `data: {"data":"${b64("f")}"}`]));
        setTimeout(() => res.socket.destroy(), 50); // the connection drops mid-stream
      } else {
        res.write(sse(["id: 10", "event: gap", 'data: {"lost":4}']));
        res.end(sse(["event: exit", 'data: {"exitCode":2,"timedOut":false}']));
      }
    };
    const got = [];
    for await (const ev of client.runtime.processes.output("vm-1", 7)) {
      got.push(ev.type === "exit" ? `exit:${ev.exitCode}` : ev.type === "gap" ? `gap:${ev.lost}:${ev.offset}` : `${ev.type}:${new TextDecoder().decode(ev.data)}:${ev.offset}`);
    }
    assert.deepEqual(got, ["stdout:abc:3", "stderr:de:5", "stdout:f:6", "gap:4:10", "exit:2"]);
    assert.deepEqual(froms, ["0", "5", "6", "6"]);
  });

  test("output stops on an error event and on a 404", async () => {
    handler = (req, res) => {
      res.writeHead(200, { "content-type": "text/event-stream" });
      res.end(sse(["event: error", 'data: {"code":"GUEST_ERROR","message":"boom"}']));
    };
    await assert.rejects(async () => {
      for await (const _ of client.runtime.processes.output("vm-1", 7)) assert.fail("no event before the error");
    }, (err) => err instanceof PalError && err.code === "STREAM_ERROR" && /boom/.test(err.message));
    handler = (req, res) => {
      res.writeHead(404, { "content-type": "application/json" });
      res.end(JSON.stringify({ error: { code: "PROCESS_NOT_FOUND", message: "no", requestId: "r" } }));
    };
    await assert.rejects(async () => {
      for await (const _ of client.runtime.processes.output("vm-1", 8)) assert.fail("no event");
    }, NotFoundError);
  });

  test("sendStdin resends what the server did not take", async () => {
    const bodies = [];
    handler = (req, res) => {
      const chunks = [];
      req.on("data", (c) => chunks.push(c));
      req.on("end", () => {
        const body = Buffer.concat(chunks).toString();
        bodies.push(body);
        res.writeHead(200, { "content-type": "application/json" });
        res.end(JSON.stringify({ written: Math.min(2, body.length), closed: false })); // a slow reader
      });
    };
    await client.runtime.processes.sendStdin("vm-1", 3, "hello");
    assert.deepEqual(bodies, ["hello", "llo", "o"]);
  });
});
