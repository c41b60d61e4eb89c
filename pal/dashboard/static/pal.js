// Pal dashboard: the two things htmx does not do — the streaming exec console and the
// usage charts (uPlot). No build step; loaded as-is.
"use strict";

(function () {
  const WORDS = {
    400: "Invalid request", 401: "Not signed in", 402: "Quota exhausted", 403: "Not allowed",
    404: "Not found", 409: "Not possible in this state", 413: "Too large",
    500: "Server error", 503: "Unavailable",
  };

  function csrf() {
    return document.body.dataset.csrf || "";
  }

  // -- exec console: POST, read the text/event-stream body as it arrives ---------------------

  function parseBlock(block) {
    let event = "message";
    const data = [];
    for (const line of block.split("\n")) {
      if (line.startsWith(":")) continue;
      const i = line.indexOf(":");
      const name = i < 0 ? line : line.slice(0, i);
      let value = i < 0 ? "" : line.slice(i + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      if (name === "event") event = value;
      else if (name === "data") data.push(value);
    }
    if (!data.length) return null;
    try {
      return { event, data: JSON.parse(data.join("\n")) };
    } catch (e) {
      return { event, data: { data: data.join("\n") } };
    }
  }

  function setupConsole() {
    const form = document.getElementById("console");
    if (!form) return;
    const out = document.getElementById("console-out");
    const status = document.getElementById("console-status");
    const run = document.getElementById("console-run");
    const stop = document.getElementById("console-stop");
    const input = document.getElementById("console-line");
    let abort = null;
    // Follow new output only while the reader is at the bottom by their own scrolling: a
    // command's first lines stay in view, and scrolling to the end follows like `tail -f`.
    let follow = false;
    out.addEventListener("scroll", function () {
      follow = out.scrollTop + out.clientHeight >= out.scrollHeight - 4;
    });

    function say(text, cls) {
      status.textContent = text;
      status.className = "status " + (cls || "");
    }
    function append(text, cls) {
      const span = document.createElement("span");
      if (cls) span.className = cls;
      span.textContent = text;
      out.appendChild(span);
      if (follow) out.scrollTop = out.scrollHeight;
    }

    stop.addEventListener("click", function () {
      if (abort) abort.abort();
    });

    form.addEventListener("submit", async function (ev) {
      ev.preventDefault();
      const line = input.value.trim();
      if (!line || abort) return;
      out.textContent = "";
      out.scrollTop = 0;
      follow = false;
      append("$ " + line + "\n", "cmd");
      say("running…");
      run.disabled = true;
      stop.disabled = false;
      abort = new AbortController();
      let ended = false;
      try {
        const resp = await fetch("/runtime/" + form.dataset.vm + "/exec", {
          method: "POST",
          headers: { "Content-Type": "application/json", "Accept": "text/event-stream", "X-CSRF-Token": csrf() },
          body: JSON.stringify({ line }),
          signal: abort.signal,
          credentials: "same-origin",
        });
        if (!resp.ok) {
          let msg = resp.statusText;
          try { msg = (await resp.json()).error.message; } catch (e) { /* not JSON */ }
          say((WORDS[resp.status] || "Error") + " (" + resp.status + "): " + msg, "err");
          ended = true;
          return;
        }
        const reader = resp.body.getReader();
        const decoder = new TextDecoder();
        let buf = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buf += decoder.decode(value, { stream: true });
          let cut;
          while ((cut = buf.indexOf("\n\n")) >= 0) {
            const ev = parseBlock(buf.slice(0, cut));
            buf = buf.slice(cut + 2);
            if (!ev) continue;
            if (ev.event === "stdout") append(ev.data.data || "");
            else if (ev.event === "stderr") append(ev.data.data || "", "stderr");
            else if (ev.event === "exit") {
              ended = true;
              const code = ev.data.exitCode;
              say("exit code " + code + (ev.data.timedOut ? " (timed out)" : ""), code === 0 ? "ok" : "err");
            } else if (ev.event === "error") {
              ended = true;
              say("error " + ev.data.code + ": " + ev.data.message, "err");
            }
          }
        }
        if (!ended) say("the stream ended without an exit code", "err");
      } catch (e) {
        if (e.name === "AbortError") say("stopped", "err");
        else say("connection failed: " + e, "err");
      } finally {
        abort = null;
        run.disabled = false;
        stop.disabled = true;
      }
    });
  }

  // -- usage charts ------------------------------------------------------------------------------

  const MiB = 1024 * 1024;

  function setupCharts() {
    const cpuEl = document.getElementById("chart-cpu");
    const memEl = document.getElementById("chart-mem");
    if (!cpuEl || !memEl || typeof uPlot === "undefined") return;
    const note = document.getElementById("metrics-note");
    const vm = cpuEl.dataset.vm;
    const netEl = document.getElementById("chart-net");
    const netFig = document.getElementById("fig-net");
    let cpu = null;
    let mem = null;
    let net = null;

    function size(el) {
      return { width: Math.max(240, el.clientWidth), height: 200 };
    }
    function make(el, series, data, floorMax) {
      // y from 0, so a spike reads as a spike and an idle guest as idle
      const y = function (u, min, max) {
        return [0, Math.max(floorMax, (max || 0) * 1.1)];
      };
      const opts = Object.assign(size(el), {
        series: [{}].concat(series),
        axes: [{}, { size: 50 }],
        scales: { x: { time: true }, y: { range: y } },
        legend: { live: false },
        cursor: { drag: { x: false, y: false } },
      });
      return new uPlot(opts, data, el);
    }
    function col(samples, f) {
      return samples.map(function (s) { const v = f(s); return v === null || v === undefined ? null : v; });
    }

    async function refresh() {
      let body;
      try {
        const resp = await fetch("/runtime/" + vm + "/metrics.json", { credentials: "same-origin" });
        if (!resp.ok) {
          note.textContent = "(" + (WORDS[resp.status] || resp.status) + ")";
          return;
        }
        body = await resp.json();
      } catch (e) {
        return;
      }
      const s = body.samples;
      const t = s.map(function (x) { return x.t / 1000; });
      const cpuData = [t, col(s, function (x) { return x.cpuPct; })];
      const memData = [
        t,
        col(s, function (x) { return x.rssBytes === null ? null : x.rssBytes / MiB; }),
        col(s, function (x) { return x.pssBytes === null ? null : x.pssBytes / MiB; }),
        col(s, function (x) { return x.guestMemUsedBytes === null ? null : x.guestMemUsedBytes / MiB; }),
      ];
      // Network counters are cumulative per QEMU incarnation: show the rate between samples
      // (null across a restart, where the counter goes back).
      const rate = function (key) {
        return s.map(function (x, i) {
          const prev = s[i - 1];
          if (!prev || x[key] === null || prev[key] === null || x[key] < prev[key]) return null;
          return (x[key] - prev[key]) / 1024 / Math.max(0.001, (x.t - prev.t) / 1000);
        });
      };
      const netData = [t, rate("netRxBytes"), rate("netTxBytes")];
      const hasNet = s.some(function (x) { return x.netRxBytes !== null && x.netRxBytes !== undefined; });
      if (hasNet && !net) {
        netFig.hidden = false;
        net = make(netEl, [
          { label: "to guest", stroke: "#2457c5" },
          { label: "from guest", stroke: "#9a6700" },
        ], netData, 1);
      } else if (net) {
        net.setData(netData);
      }
      if (!cpu) {
        cpu = make(cpuEl, [{ label: "CPU %", stroke: "#2457c5", fill: "rgba(36,87,197,.12)" }], cpuData, 100);
        mem = make(memEl, [
          { label: "RSS", stroke: "#9a6700" },
          { label: "PSS", stroke: "#1e7a3c" },
          { label: "guest used", stroke: "#b3261e" },
        ], memData, 64);
      } else {
        cpu.setData(cpuData);
        mem.setData(memData);
      }
      const values = cpuData[1].filter(function (v) { return v !== null; });
      cpuEl.dataset.points = String(values.length);
      cpuEl.dataset.peak = values.length ? String(Math.max.apply(null, values)) : "";
      cpuEl.dataset.last = values.length ? String(values[values.length - 1]) : "";
      cpuEl.dataset.lastT = s.length ? String(s[s.length - 1].t) : "";
      note.textContent = s.length
        ? "(" + s.length + " samples, every " + body.intervalSecs + " s" + (body.live ? ")" : "; not running: last samples)")
        : "(no samples yet: one every " + body.intervalSecs + " s)";
    }

    window.addEventListener("resize", function () {
      if (cpu) cpu.setSize(size(cpuEl));
      if (mem) mem.setSize(size(memEl));
      if (net) net.setSize(size(netEl));
    });
    refresh();
    setInterval(refresh, 5000);
  }

  document.addEventListener("DOMContentLoaded", function () {
    setupConsole();
    setupCharts();
  });
})();
