// The VM page's terminal: xterm.js on a shell in the VM, attached over the processes'
// WebSocket attach (docs/processes.md). POST /runtime/{vm}/terminal starts the shell (or
// finds the one this dashboard left running) and answers a short-lived signed attach link;
// keystrokes go out as binary frames, output comes back as binary frames, and the size
// follows the panel's. After a pause the socket ends with `detached`: "Reattach" asks for a
// new link and goes on from the offset reached, so nothing is shown twice or lost.
(function () {
  "use strict";

  const panel = document.getElementById("terminal-panel");
  if (!panel) return;

  // xterm.js writes its layout and colours into <style> elements; the page's CSP admits
  // only those carrying this response's nonce (pal/dashboard/terminal.py).
  const nonce = panel.dataset.styleNonce;
  if (nonce) {
    const create = Document.prototype.createElement;
    Document.prototype.createElement = function (name, options) {
      const el = create.call(this, name, options);
      if (String(name).toLowerCase() === "style") el.setAttribute("nonce", nonce);
      return el;
    };
  }

  const vm = panel.dataset.vm;
  const box = document.getElementById("terminal");
  const openBtn = document.getElementById("terminal-open");
  const endBtn = document.getElementById("terminal-end");
  const status = document.getElementById("terminal-status");
  const encoder = new TextEncoder();
  let term = null;
  let fit = null;
  let ws = null;
  let pid = null;
  let offset = 0;
  let exited = false;

  function say(text) {
    status.textContent = text;
  }

  async function link(body) {
    const r = await fetch(`/runtime/${encodeURIComponent(vm)}/terminal`, {
      method: "POST",
      headers: { "Content-Type": "application/json", "X-CSRF-Token": document.body.dataset.csrf || "" },
      body: JSON.stringify(body),
    });
    let answer = {};
    try {
      answer = await r.json();
    } catch (e) {
      answer = {};
    }
    if (!r.ok) throw new Error((answer.error && answer.error.message) || `HTTP ${r.status}`);
    return answer;
  }

  function send(message) {
    if (ws && ws.readyState === WebSocket.OPEN) ws.send(message);
  }

  function sendSize() {
    if (!term) return;
    box.dataset.size = `${term.rows} ${term.cols}`; // as `stty size` says it
    send(JSON.stringify({ type: "resize", cols: term.cols, rows: term.rows }));
  }

  function notice(n) {
    if (n.type === "attached") {
      say(`attached to process ${n.processId}`);
      openBtn.disabled = true;
      endBtn.disabled = false;
      sendSize();
    } else if (n.type === "exit") {
      exited = true;
      offset = n.offset;
      say(`exited with code ${n.exitCode}`);
    } else if (n.type === "detached") {
      offset = n.offset;
      say(`detached (${n.reason}); reattach to go on`);
    } else if (n.type === "gap") {
      offset = n.offset;
      term.write(`\r\n[${n.lost} bytes of output were dropped]\r\n`);
    } else if (n.type === "error") {
      say(`error (${n.status}): ${n.message}`);
    }
  }

  function connect(url) {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    ws = new WebSocket(`${scheme}//${location.host}${url}&from=${offset}`);
    ws.binaryType = "arraybuffer";
    ws.onmessage = (m) => {
      if (typeof m.data === "string") {
        notice(JSON.parse(m.data));
        return;
      }
      const bytes = new Uint8Array(m.data);
      offset += bytes.length;
      term.write(bytes);
    };
    ws.onclose = () => {
      ws = null;
      endBtn.disabled = true;
      openBtn.disabled = false;
      openBtn.textContent = exited ? "Open terminal" : "Reattach";
      if (exited) pid = null;
      if (!exited && !status.textContent.startsWith("detached")) say("connection closed; reattach to go on");
    };
  }

  function ensureTerm() {
    if (term) return;
    box.hidden = false;
    term = new window.Terminal({ convertEol: false, scrollback: 5000, fontSize: 14 });
    fit = new window.FitAddon.FitAddon();
    term.loadAddon(fit);
    term.open(box);
    fit.fit();
    term.onData((d) => send(encoder.encode(d)));
    term.onBinary((d) => send(Uint8Array.from(d, (c) => c.charCodeAt(0) & 255)));
    term.onResize(() => sendSize());
    new ResizeObserver(() => fit.fit()).observe(box);
  }

  async function open() {
    openBtn.disabled = true;
    try {
      ensureTerm();
      if (pid === null) {
        term.reset();
        offset = 0;
        exited = false;
      }
      say(pid === null ? "starting a shell…" : "reattaching…");
      const body = pid === null ? { cols: term.cols, rows: term.rows } : { processId: pid };
      const answer = await link(body);
      pid = answer.processId;
      connect(answer.url);
      term.focus();
    } catch (e) {
      say(String(e.message || e));
      openBtn.disabled = false;
    }
  }

  openBtn.addEventListener("click", open);
  // The button comes disabled: a click before this script ran would do nothing.
  openBtn.disabled = false;
  // End: the shell is hung up (SIGHUP to its group), as when a terminal window closes.
  endBtn.addEventListener("click", () => send(JSON.stringify({ type: "signal", signal: "HUP" })));
})();
