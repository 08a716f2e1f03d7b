// rtxops dashboard: draws the charts from /api JSON and keeps the page live by polling.
// Tables are rendered by the server; this script only swaps in fresher copies of them.
"use strict";
(() => {
  const REFRESH_MS = 5000;
  const LOG_POLL_MS = 2000;
  const FETCH_TIMEOUT_MS = 10000;   // a daemon that hangs (stopped, a stuck store) reads offline
  const LOG_PAGE = 1000;
  const LOG_PAGES_PER_POLL = 5;     // a chatty job's log is read at up to 5000 lines every 2 s
  const LOG_MAX_LINES = 5000;       // lines kept on the page; the oldest go first
  // plotly reads a few HTML-like tags in text; every label from the store is shown literally
  const esc = (s) => String(s ?? "").replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  // UTC wall-clock strings, as the tables print times: plotly shows a Date in the browser's zone
  const date = (ns) => new Date(ns / 1e6).toISOString().replace("Z", "");
  const base = (extra) => Object.assign({
    margin: { t: 24, r: 60, b: 40, l: 60 }, height: 340, hovermode: "closest",
    legend: { orientation: "h", y: -0.2 }, xaxis: { type: "date", title: { text: "UTC" } },
  }, extra);
  const sum = (xs) => xs.reduce((a, b) => a + (b || 0), 0);

  const charts = {
    steps(d) {
      const traces = [];
      for (const s of d.series) {
        const x = s.t_ns.map(date);
        traces.push({ type: "scatter", mode: "lines+markers", x, y: s.p50_ms, name: esc(`${s.job_id} p50`) });
        traces.push({ type: "scatter", mode: "lines", x, y: s.p95_ms, name: esc(`${s.job_id} p95`), line: { dash: "dot" } });
      }
      const color = (m) => (m.kind === "rollback" ? "#c0392b" : "#1e8449");
      const shapes = d.markers.map((m) => ({
        type: "line", xref: "x", yref: "paper", x0: date(m.at_ns), x1: date(m.at_ns), y0: 0, y1: 1,
        line: { dash: "dash", width: 1.5, color: color(m) },
      }));
      const annotations = d.markers.map((m) => ({
        x: date(m.at_ns), y: 1, xref: "x", yref: "paper", yanchor: "bottom", showarrow: false,
        font: { color: color(m), size: 11 },
        text: esc(`${m.kind} ${m.plan_from ?? "?"}→${m.plan_to ?? "?"}`),
      }));
      return { traces, layout: base({ yaxis: { title: { text: "step time (ms)" }, rangemode: "tozero" }, shapes, annotations }),
               markers: d.markers.length };
    },
    kseries(d) {
      const traces = [];
      const jobs = new Set(d.series.map((s) => s.job_id));
      for (const s of d.series) {
        const label = `${jobs.size > 1 ? s.job_id + " " : ""}${s.op} ${s.variant}${s.config && s.config !== "{}" ? " " + s.config : ""} ${s.phase}`;
        const x = s.t_ns.map(date);
        const dash = s.phase === "bwd" ? "dot" : "solid";
        traces.push({ type: "scatter", mode: "lines+markers", x, y: s.p50_us, name: esc(`${label} p50`), line: { dash } });
        traces.push({ type: "scatter", mode: "lines", x, y: s.p95_us, name: esc(`${label} p95`), line: { dash, width: 1 }, visible: "legendonly" });
      }
      return { traces, layout: base({ yaxis: { title: { text: "time per call (µs)" }, type: "log" } }) };
    },
    breakdown(d) {
      if (!d.swap) return { traces: [] };
      const perOp = (rows) => {
        const out = Object.create(null);  // keyed by names from telemetry: no prototype
        for (const r of rows) out[r.op] = (out[r.op] || 0) + (r.per_step_ns || 0) / 1e6;
        return out;
      };
      const before = perOp(d.before), after = perOp(d.after);
      const ops = [...new Set([...Object.keys(before), ...Object.keys(after)])].sort();
      const traces = ops.map((op) => ({
        type: "bar", name: esc(op), x: ["before", "after"], y: [before[op] || 0, after[op] || 0],
      }));
      return { traces, layout: base({ barmode: "stack", xaxis: { type: "category" },
        yaxis: { title: { text: "kernel time per step (ms)" } },
        title: { text: esc(`swap at step ${d.swap.step}: plan ${d.swap.plan_from} → ${d.swap.plan_to}`), font: { size: 13 } } }) };
    },
    trials(d) {
      const byVariant = Object.create(null);
      for (const t of d.items) {
        if (t.median_ns == null || t.started_ns == null) continue;
        const g = (byVariant[t.variant] ||= { x: [], y: [], text: [] });
        g.x.push(date(t.started_ns)); g.y.push(t.median_ns / 1e3); g.text.push(esc(`${t.trial_id} ${t.config ?? ""} ${t.status ?? ""}`));
      }
      const traces = Object.entries(byVariant).map(([v, g]) => ({
        type: "scatter", mode: "markers", name: esc(v), x: g.x, y: g.y, text: g.text, marker: { size: 9 },
      }));
      return { traces, layout: base({ yaxis: { title: { text: "median per call (µs)" } } }) };
    },
    memory(d) {
      const traces = [];
      const jobs = Object.create(null);
      for (const r of d.series) (jobs[r.job_id] ||= []).push(r);
      const fields = [["rss_bytes", "RSS"], ["cuda_allocated_bytes", "CUDA allocated"],
                      ["cuda_reserved_bytes", "CUDA reserved"], ["cuda_peak_bytes", "CUDA peak"]];
      for (const [job, rows] of Object.entries(jobs)) {
        const x = rows.map((r) => date(r.t_ns));
        for (const [f, label] of fields) {
          const y = rows.map((r) => (r[f] == null ? null : r[f] / 2 ** 20));
          if (y.some((v) => v != null)) traces.push({ type: "scatter", mode: "lines+markers", x, y, name: esc(`${job} ${label}`) });
        }
        const frag = rows.map((r) => r.cuda_fragmentation);
        if (frag.some((v) => v != null)) traces.push({ type: "scatter", mode: "lines", x, y: frag, yaxis: "y2", name: esc(`${job} fragmentation`), line: { dash: "dot" } });
      }
      return { traces, layout: base({ yaxis: { title: { text: "MiB" }, rangemode: "tozero" },
        yaxis2: { title: { text: "fragmentation" }, overlaying: "y", side: "right", range: [0, 1] } }) };
    },
  };

  // the answer's body read with ``read`` (the timeout covers it too: a body can stall as well)
  async function fetchInTime(url, options, read) {
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(), FETCH_TIMEOUT_MS);
    try {
      const r = await fetch(url, Object.assign({ cache: "no-store", signal: abort.signal }, options));
      if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
      return await read(r);
    } finally {
      clearTimeout(timer);
    }
  }

  async function getJson(url) {
    return fetchInTime(url, { headers: { Accept: "application/json" } }, (r) => r.json());
  }

  // each poller's last outcome: the badge reads live only while none of them failed (one that
  // succeeded must not cover for another that cannot reach the daemon)
  const health = {};
  function report(poller, ok) {
    health[poller] = ok;
    const el = document.getElementById("live");
    const live = Object.values(health).every(Boolean);
    if (el) { el.classList.toggle("offline", !live); el.textContent = live ? "live" : "offline"; }
  }

  async function draw(el) {
    const fig = charts[el.dataset.chart](await getJson(el.dataset.src));
    const points = sum(fig.traces.map((t) => (t.y || []).filter((v) => v != null).length));
    el.dataset.points = String(points);
    el.dataset.markers = String(fig.markers || 0);
    if (!points) {
      if (el.dataset.drawn) window.Plotly.purge(el);
      delete el.dataset.drawn;
      el.classList.add("no-data");
      el.textContent = "No data in this window.";
      return;
    }
    if (!el.dataset.drawn) el.textContent = "";
    el.classList.remove("no-data");
    // the same uirevision on every redraw: a zoom or a legend choice outlives the refresh
    const layout = Object.assign({}, fig.layout, { uirevision: el.id });
    await window.Plotly.react(el, fig.traces, layout, { displaylogo: false, responsive: true });
    el.dataset.drawn = "1";
  }

  async function refreshSections() {
    const live = [...document.querySelectorAll("[data-live][id]")];
    if (!live.length) return;
    const text = await fetchInTime(location.href, {}, (r) => r.text());
    const fresh = new DOMParser().parseFromString(text, "text/html");
    const selection = document.getSelection();
    for (const el of live) {
      const next = fresh.getElementById(el.id);
      if (!next || el.contains(document.activeElement)) continue;
      // text the user is selecting stays put
      if (selection && !selection.isCollapsed && el.contains(selection.anchorNode)) continue;
      // a chart in the section stays the element it is (its zoom with it); only its source moves
      const charts = new Map([...el.querySelectorAll("[data-chart][id]")].map((c) => [c.id, c]));
      const kept = userState(el);
      el.replaceChildren(...next.childNodes);
      for (const c of el.querySelectorAll("[data-chart][id]")) {
        const old = charts.get(c.id);
        if (old) { old.dataset.src = c.dataset.src; c.replaceWith(old); }
      }
      restoreUserState(el, kept);
    }
  }

  // what the user did inside a live section that the server's markup does not carry: opened
  // <details> (a hung job's stacks) and typed filter text
  function userState(el) {
    const summary = (d) => (d.querySelector("summary") || d).textContent;
    return {
      open: new Set([...el.querySelectorAll("details[open]")].map(summary)),
      typed: new Map([...el.querySelectorAll("input[name]")]
        .filter((i) => i.value !== i.defaultValue).map((i) => [i.name, i.value])),
      summary,
    };
  }

  function restoreUserState(el, kept) {
    for (const d of el.querySelectorAll("details")) if (kept.open.has(kept.summary(d))) d.open = true;
    for (const i of el.querySelectorAll("input[name]")) {
      if (kept.typed.has(i.name)) i.value = kept.typed.get(i.name);
    }
  }

  // resolves to false when there is nothing to follow (no log here, follow unticked): that
  // says nothing of the daemon
  async function followLog() {
    const log = document.getElementById("log");
    const follow = document.getElementById("follow");
    if (!log || !follow || !follow.checked || document.hidden) return false;
    const url = (after) => {
      const params = new URLSearchParams({ after, limit: String(LOG_PAGE) });
      if (log.dataset.search) params.set("search", log.dataset.search);
      return `/api/jobs/${encodeURIComponent(log.dataset.job)}/logs?${params}`;
    };
    let added = 0;
    for (let page = 0; page < LOG_PAGES_PER_POLL; page++) {
      const after = Number(log.dataset.after);
      const d = await getJson(url(after));
      for (const line of d.lines) {
        if (line.seq <= after) continue;   // (shown already)
        log.append(lineElement(line), "\n");
        added++;
      }
      log.dataset.after = String(Math.max(after, d.last_seq));
      if (d.lines.length < LOG_PAGE) break;
    }
    if (added) {
      const empty = log.parentElement.querySelector(":scope > .empty");
      if (empty) empty.remove();   // "No output yet." under lines that came since
      trimLog(log);
      log.scrollTop = log.scrollHeight;
    }
    return true;
  }

  function lineElement(line) {
    const span = document.createElement("span");
    span.className = line.stream;
    span.textContent = (line.rank !== 0 ? `[rank ${line.rank}] ` : "") + line.text;  // text, never HTML
    if (line.cut) {   // a line cut for display: its whole text is in `rtxops logs`
      const cut = document.createElement("span");
      cut.className = "cut";
      cut.textContent = ` … (${line.size} bytes in all: rtxops logs)`;
      span.append(cut);
    }
    return span;
  }

  // the page holds the newest LOG_MAX_LINES lines (each a span and its newline): a chatty job
  // followed for an hour grew the page without end
  function trimLog(log) {
    const lines = log.querySelectorAll(":scope > span:not(.trimmed)");
    const extra = lines.length - LOG_MAX_LINES;
    if (extra <= 0) return;
    for (let i = 0; i < extra; i++) {
      const next = lines[i].nextSibling;
      if (next && next.nodeType === Node.TEXT_NODE) next.remove();
      lines[i].remove();
    }
    let note = log.querySelector(":scope > .trimmed");
    if (!note) {
      note = document.createElement("span");
      note.className = "trimmed";
      log.prepend(note, "\n");
    }
    note.dataset.count = String(Number(note.dataset.count || 0) + extra);
    note.textContent = `… ${note.dataset.count} earlier lines left out here (rtxops logs has them)`;
  }

  function every(name, ms, fn) {
    // one call at a time: an answer slower than the period started a second one (log lines
    // shown twice, refreshes piling up on a slow store)
    let running = false;
    setInterval(() => {
      if (document.hidden || running) return;
      running = true;
      fn().then((did) => { if (did !== false) report(name, true); }, () => report(name, false))
        .finally(() => { running = false; });
    }, ms);
  }

  // plotly.js (4.8 MB) loads after the page did, and only where there are charts: the tables
  // are readable at once, the charts follow
  let plotly = null;   // one load, however many refreshes ask for it while it comes
  function loadPlotly() {
    if (window.Plotly) return Promise.resolve();
    if (!plotly) {
      plotly = new Promise((resolve, reject) => {
        const script = document.createElement("script");
        script.src = "/static/vendor/plotly.min.js";
        script.onload = resolve;
        script.onerror = () => { plotly = null; script.remove(); reject(new Error("plotly.js did not load")); };
        document.head.append(script);
      });
    }
    return plotly;
  }

  async function drawAll() {
    const els = [...document.querySelectorAll("[data-chart]")];
    if (!els.length) return;
    await loadPlotly();
    const results = await Promise.allSettled(els.map(draw));
    const failed = results.find((r) => r.status === "rejected");
    if (failed) throw failed.reason;
  }

  function start() {
    drawAll().then(() => report("page", true), () => report("page", false));
    every("page", REFRESH_MS, async () => { await refreshSections(); await drawAll(); });
    every("log", LOG_POLL_MS, followLog);
  }

  if (document.readyState === "complete") start();
  else window.addEventListener("load", start);
})();
