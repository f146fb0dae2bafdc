// HYDRA training dashboard: polls the JSON endpoints of hydra_diag/dashboard/server.py and draws
// with plotly.js. Each run keeps, per table, the last step it holds ("cursor"); a poll asks only
// for rows after it, so a long run costs one full load and then a few rows per poll.
"use strict";

const POLL_MS = 2000;
// rows a table a response (the server keeps every k-th step and the last): a long run's first load
// stays a few MB, and plotly draws it at once; later polls hold a few new rows each
const MAX_ROWS = 20000;
const TABLES = ["steps", "evals", "adaptive_lr", "routing_mod", "routing_mor", "routing_moe"];
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
const state = { runs: [], selected: null, compared: new Set(), data: {}, polls: 0, renders: 0, busy: false, dirty: true, follow: true };
window.hydraDashboard = state; // read by the browser test and handy in the devtools console

function runData(id) {
  if (!state.data[id]) {
    state.data[id] = {
      rows: Object.fromEntries(TABLES.map((t) => [t, []])),
      cursor: Object.fromEntries(TABLES.map((t) => [t, -1])),
      run: null, safe: null, meta: null,
    };
  }
  return state.data[id];
}

async function getJSON(url) {
  const r = await fetch(url, { cache: "no-store" });
  const body = await r.json();
  if (!r.ok) throw new Error(body.error || r.statusText);
  return body;
}

async function pull(id) {
  const d = runData(id);
  const query = TABLES.map((t) => `${t}=${d.cursor[t]}`).join("&") + `&max_rows=${MAX_ROWS}`;
  const got = await getJSON(`/api/run/${encodeURIComponent(id)}?${query}`);
  d.run = got.run;
  d.safe = got.safe_opts;
  let fresh = 0;
  // the run's status and SafeOptimizations events change without new rows (finish_run commits
  // on its own, after the last step): redraw when they do, not only on new rows
  const meta = JSON.stringify([got.run, got.safe_opts]);
  if (meta !== d.meta) { d.meta = meta; fresh += 1; }
  for (const t of TABLES) {
    const held = got.last[t] ?? -1;
    if (held < d.cursor[t]) {
      // a resume superseded the rows after its checkpoint and the database dropped them: so do we
      d.rows[t] = d.rows[t].filter((r) => r.step <= held);
      d.cursor[t] = held;
      fresh += 1;
    }
    const rows = got[t];
    if (rows.length) {
      d.rows[t] = d.rows[t].concat(rows); // not push(...rows): a first load may hold 20K rows
      d.cursor[t] = rows[rows.length - 1].step;
      fresh += rows.length;
    }
  }
  return fresh;
}

async function tick() {
  if (state.busy) { state.dirty = true; return; }
  state.busy = true;
  try {
    const r = await getJSON("/api/runs");
    state.runs = r.runs;
    document.getElementById("database").textContent = r.database;
    const newest = r.runs.length ? r.runs[r.runs.length - 1].run_id : null;
    if (state.follow && newest && newest !== state.selected) {
      // until a run is clicked, show the newest one: a run started later takes over the page
      state.compared.delete(state.selected);
      state.selected = newest;
      state.compared.add(newest);
      state.dirty = true;
    }
    let fresh = 0;
    for (const id of new Set([state.selected, ...state.compared])) fresh += await pull(id);
    renderRuns();
    if (fresh || state.dirty) { state.dirty = false; render(); }
    state.polls += 1;
    setLive(true, "live · updated " + new Date().toLocaleTimeString());
  } catch (e) {
    setLive(false, "not updating: " + e.message);
  } finally {
    state.busy = false;
  }
}

function setLive(ok, text) {
  const el = document.getElementById("live");
  el.className = "live " + (ok ? "ok" : "stale");
  el.textContent = text;
}

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}

function renderRuns() {
  const ul = document.getElementById("runs");
  ul.replaceChildren();
  for (const r of state.runs.slice().reverse()) {
    const li = el("li", undefined, r.run_id === state.selected ? "selected" : "");
    const box = el("input");
    box.type = "checkbox";
    box.checked = state.compared.has(r.run_id);
    box.title = "overlay this run's losses";
    box.onclick = (ev) => {
      ev.stopPropagation();
      if (box.checked) state.compared.add(r.run_id); else state.compared.delete(r.run_id);
      state.dirty = true; tick();
    };
    const text = el("div");
    text.append(el("div", r.run_id), el("div", `${r.model_id} · `, "meta"));
    text.lastChild.append(el("span", r.status, "status-" + r.status), ` · step ${r.last_step ?? "-"}`);
    li.append(box, text);
    li.onclick = () => { state.selected = r.run_id; state.follow = false; state.dirty = true; tick(); };
    ul.append(li);
  }
}

const fmt = (v, digits = 4) => (v === null || v === undefined ? "-" : typeof v === "number" ? +v.toPrecision(digits) + "" : v);
const col = (rows, key) => rows.map((r) => r[key]);
const last = (rows) => rows[rows.length - 1] || {};

function renderCards(d) {
  const s = d.rows.steps, lastStep = last(s), run = d.run || {};
  const vals = d.rows.evals.map((e) => e.val_loss).filter((v) => v !== null);
  const cards = [
    ["status", run.status], ["step", lastStep.step], ["loss", fmt(lastStep.loss)],
    ["EMA short", fmt(lastStep.ema_short)], ["best val loss", fmt(vals.length ? vals.reduce((a, b) => Math.min(a, b)) : null)],
    ["tokens/s", fmt(lastStep.tokens_per_s, 3)], ["memory MiB", fmt(lastStep.memory_mb, 4)],
    ["skipped steps", lastStep.skipped_steps ?? "-"], ["model", `${run.model_id || "-"} (${run.params ? (run.params / 1e6).toFixed(2) + "M" : "?"})`],
    ["device", run.device || "-"],
  ];
  const box = document.getElementById("cards");
  box.replaceChildren(...cards.map(([k, v]) => {
    const c = el("div", undefined, "card");
    c.append(el("div", k, "label"), el("div", String(v ?? "-"), "value"));
    return c;
  }));
}

function plot(id, traces, layout = {}) {
  const points = traces.reduce((n, t) => n + (t.z ? t.z.length : t.x.length), 0);
  const base = {
    margin: { l: 55, r: 55, t: 26, b: 36 }, showlegend: true, autosize: true,
    legend: { orientation: "h", x: 0, y: 1.0, yanchor: "bottom" },
    xaxis: { title: { text: "step" } }, uirevision: state.selected, font: { size: 11 },
    annotations: points ? [] : [{ text: "nothing logged for this run", showarrow: false, xref: "paper", yref: "paper", x: 0.5, y: 0.5 }],
  };
  Plotly.react(id, traces, { ...base, ...layout, xaxis: { ...base.xaxis, ...(layout.xaxis || {}) } }, { responsive: true, displayModeBar: false }); // drag zooms, a double click resets
}

const line = (x, y, name, extra = {}) => ({ x, y, name, type: "scatter", mode: "lines", ...extra });

function byLayer(rows) {
  const out = new Map();
  for (const r of rows) { if (!out.has(r.layer)) out.set(r.layer, []); out.get(r.layer).push(r); }
  return [...out.entries()].sort((a, b) => a[0] - b[0]);
}

function render() {
  if (!state.selected) return;
  const d = runData(state.selected), s = d.rows.steps, x = col(s, "step");
  renderCards(d);
  plot("chart-loss", [
    line(x, col(s, "loss"), "loss", { line: { color: "#b0b7c3", width: 1 } }),
    line(x, col(s, "ema_short"), "EMA short (0.99)", { line: { color: COLORS[0] } }),
    line(x, col(s, "ema_medium"), "EMA medium (0.999)", { line: { color: COLORS[2] } }),
    line(x, col(s, "ema_long"), "EMA long (0.9999)", { line: { color: COLORS[3] } }),
    line(col(d.rows.evals, "step"), col(d.rows.evals, "val_loss"), "validation", { mode: "lines+markers", line: { color: COLORS[1] } }),
  ]);
  const cmp = [];
  [...state.compared].forEach((id, i) => {
    const c = runData(id), color = COLORS[i % COLORS.length];
    cmp.push(line(col(c.rows.steps, "step"), col(c.rows.steps, "ema_short"), `${id} EMA short`, { line: { color } }));
    cmp.push(line(col(c.rows.evals, "step"), col(c.rows.evals, "val_loss"), `${id} val`, { mode: "lines+markers", line: { color, dash: "dot" } }));
  });
  plot("chart-compare", cmp);
  const phases = d.rows.adaptive_lr.map((r) => `phase ${r.phase}, factor ${fmt(r.factor, 3)}`);
  plot("chart-lr", [line(col(d.rows.adaptive_lr, "step"), col(d.rows.adaptive_lr, "lr"), "lr", { text: phases })], { yaxis: { exponentformat: "e" } });
  plot("chart-grad", [line(x, col(s, "grad_norm"), "grad norm")]);
  plot("chart-tps", [line(x, col(s, "tokens_per_s"), "tokens/s")]);
  const skippedMax = s.reduce((m, r) => Math.max(m, r.skipped_steps || 0), 1); // integer ticks
  plot("chart-mem", [
    line(x, col(s, "memory_mb"), "memory MiB"),
    line(x, col(s, "skipped_steps"), "skipped steps (total)", { yaxis: "y2", line: { dash: "dot", color: COLORS[1] } }),
  ], { yaxis2: { overlaying: "y", side: "right", range: [0, 1.1 * skippedMax], dtick: skippedMax < 10 ? 1 : null, tickformat: "d" } });
  const mod = d.rows.routing_mod, modSteps = [...new Set(col(mod, "step"))];
  const modLayers = byLayer(mod);
  const heat = modLayers.length ? [{
    type: "heatmap", x: modSteps, y: modLayers.map(([l]) => `layer ${l}`), zmin: 0, zmax: 1, colorscale: "Viridis",
    z: modLayers.map(([, rows]) => { const at = new Map(rows.map((r) => [r.step, r.selected_frac])); return modSteps.map((st) => at.get(st) ?? null); }),
    colorbar: { title: { text: "selected" } }, name: "MoD",
  }] : [];
  plot("chart-mod", heat, { showlegend: false });
  const mor = [];
  byLayer(d.rows.routing_mor).forEach(([l, rows], i) => {
    const color = COLORS[i % COLORS.length];
    mor.push(line(col(rows, "step"), col(rows, "avg_depth"), `layer ${l} average`, { line: { color } }));
    mor.push(line(col(rows, "step"), col(rows, "expected_depth"), `layer ${l} expected`, { line: { color, dash: "dash" } }));
  });
  plot("chart-mor", mor);
  const moe = [];
  byLayer(d.rows.routing_moe).forEach(([l, rows], i) => {
    const color = COLORS[i % COLORS.length];
    const util = rows.map((r) => "utilisation " + (r.utilization || []).map((u) => fmt(u, 2)).join(" "));
    moe.push(line(col(rows, "step"), col(rows, "entropy"), `layer ${l} entropy`, { line: { color }, text: util }));
    moe.push(line(col(rows, "step"), col(rows, "kl_to_uniform"), `layer ${l} KL`, { line: { color, dash: "dot" }, yaxis: "y2" }));
  });
  plot("chart-moe", moe, { yaxis2: { overlaying: "y", side: "right", title: { text: "KL" } } });
  const moeLast = d.rows.routing_moe.filter((r) => r.step === d.cursor.routing_moe);
  const util = moeLast.length ? [{
    type: "heatmap", name: "utilisation", colorscale: "Viridis", zmin: 0, colorbar: { title: { text: "share" } },
    x: (moeLast[0].utilization || []).map((_, e) => `expert ${e}`), y: moeLast.map((r) => `layer ${r.layer}`),
    z: moeLast.map((r) => r.utilization || []),
  }] : [];
  plot("chart-moe-util", util, { showlegend: false, xaxis: { title: { text: `expert (step ${d.cursor.routing_moe})` } } });
  renderSafe(d.safe);
  state.renders += 1;
}

function table(headers, rows) {
  const t = el("table"), head = el("tr");
  headers.forEach((h) => head.append(el("th", h)));
  t.append(head);
  for (const r of rows) { const tr = el("tr"); r.forEach((v) => tr.append(el("td", String(v ?? "-")))); t.append(tr); }
  return t;
}

function renderSafe(safe) {
  const box = document.getElementById("safe-opts");
  box.replaceChildren();
  if (!safe) return;
  const req = safe.requested;
  box.append(el("p", req === null ? "requested: unknown (the run's config could not be read)"
    : `requested: ${req.length ? req.join(", ") : "none (every optimization OFF)"}`));
  const names = Object.keys(safe.status);
  if (names.length) {
    box.append(table(["optimization", "status", "since step", "reason"],
      names.map((n) => [n, safe.status[n].status, safe.status[n].step, safe.status[n].reason])));
  }
  box.append(el("p", safe.anomalies.length ? `${safe.anomalies.length} anomalies:` : `no anomalies in ${safe.log}`));
  if (safe.anomalies.length) {
    box.append(table(["step", "kind", "blamed on", "value", "baseline"],
      safe.anomalies.map((a) => [a.at_step, a.kind, a.name ?? "no optimization", fmt(a.value), fmt(a.baseline)])));
  }
}

tick();
setInterval(tick, POLL_MS);
