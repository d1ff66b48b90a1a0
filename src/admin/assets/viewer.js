// promptgate viewer: a plain ES module, no bundler, no dependencies. It reads the
// admin JSON API and the live feed (/api/live) and builds every node through the
// DOM, never from HTML strings: captured prompts are text, whatever they contain.

const ROW = 28; // px, the list's row height (viewer.css --row)
const PAGE = 5000; // rows per list request

const state = {
  vocabulary: null, // the names filters offer, from /api/vocabulary
  rows: new Map(), // id -> row, stored exchanges
  order: [], // ids, newest first
  inflight: new Map(), // id -> {started, progress}
  lastSeq: 0,
  selected: 0,
  visible: [], // ids the list shows, in order
  searchIds: null, // Set of ids a server-side search matched, or null
  filters: {},
  showSide: false,
  loaded: false,
};

// ---------------------------------------------------------------- helpers

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}

async function api(path) {
  const r = await fetch(path, { headers: { accept: "application/json" } });
  const body = await r.json().catch(() => ({ error: `HTTP ${r.status}` }));
  if (!r.ok) throw new Error(body.error || `HTTP ${r.status}`);
  return body;
}

const fmtTime = (ms) => {
  const d = new Date(ms);
  const p = (n, w = 2) => String(n).padStart(w, "0");
  return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}`;
};
const fmtNum = (n) => (n === null || n === undefined ? "" : n >= 10000 ? `${(n / 1000).toFixed(1)}k` : String(n));
const fmtUsd = (n) => (n === null || n === undefined ? "—" : `$${n.toFixed(n < 0.01 ? 4 : 3)}`);
const fmtBytes = (n) => (n >= 1048576 ? `${(n / 1048576).toFixed(1)} MB` : n >= 1024 ? `${(n / 1024).toFixed(1)} kB` : `${n} B`);
const shortConv = (c) => (c ? (c.length > 22 ? `${c.slice(0, 21)}…` : c) : "");
const verdictClass = (v) => `v-${String(v || "").split(/[ :]/)[0].toLowerCase()}`;

function setMain(...nodes) {
  const main = document.getElementById("main");
  main.replaceChildren(...nodes);
}

function navActive(name) {
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.nav === name);
}

// ---------------------------------------------------------------- data

async function loadRows() {
  state.rows.clear();
  if (!state.vocabulary) state.vocabulary = await api("/api/vocabulary");
  let offset = 0;
  for (;;) {
    const page = await api(`/api/captures?all=1&limit=${PAGE}&offset=${offset}`);
    if (offset === 0) state.lastSeq = page.last_seq || 0;
    for (const r of page.captures) state.rows.set(r.id, r);
    rebuildOrder();
    if (!state.loaded) {
      state.loaded = true;
      route();
    } else if (currentView === "list") renderList();
    if (page.captures.length < PAGE) break;
    offset += PAGE;
  }
  // For bench/viewer: when the whole store was listed.
  performance.mark("promptgate:all-rows");
}

function rebuildOrder() {
  state.order = [...state.rows.values()].sort((a, b) => b.started_ms - a.started_ms || (a.id < b.id ? 1 : -1)).map((r) => r.id);
}

function addRow(row) {
  state.inflight.delete(row.id);
  const known = state.rows.has(row.id);
  state.rows.set(row.id, row);
  if (!known) {
    // Usually the newest: insert in place without resorting everything.
    let i = 0;
    while (i < state.order.length && state.rows.get(state.order[i]).started_ms > row.started_ms) i++;
    state.order.splice(i, 0, row.id);
  }
  state.lastSeq = Math.max(state.lastSeq, row.seq);
}

// ---------------------------------------------------------------- live feed

let source = null;
function connect() {
  setLive(false, "connecting…");
  source = new EventSource(`/api/live?after=${state.lastSeq}`);
  source.addEventListener("hello", () => setLive(true, "live"));
  source.addEventListener("started", (e) => {
    const s = JSON.parse(e.data);
    state.inflight.set(s.id, { started: s, progress: null });
    liveChanged(s.id);
  });
  source.addEventListener("progress", (e) => {
    const p = JSON.parse(e.data);
    const f = state.inflight.get(p.id);
    if (f) f.progress = p;
    else state.inflight.set(p.id, { started: { id: p.id, started_ms: Date.now() }, progress: p });
    liveChanged(p.id);
  });
  source.addEventListener("recorded", (e) => {
    const row = JSON.parse(e.data);
    addRow(row);
    liveChanged(row.id, true);
  });
  source.addEventListener("reload", () => loadRows());
  source.addEventListener("error", () => setLive(false, "reconnecting…"));
}

function setLive(on, text) {
  const s = document.getElementById("live-state");
  s.textContent = text;
  s.className = on ? "state-live" : "state-off";
}

let listTimer = null;
function liveChanged(id, recorded) {
  if (currentView === "list") {
    // Coalesced: a burst of events repaints once.
    if (!listTimer) listTimer = setTimeout(() => ((listTimer = null), renderList()), 50);
  } else if (currentView === "exchange" && currentId === id) {
    if (recorded) route();
    else renderInflight(id);
  }
  updateStats();
}

function updateStats() {
  let n = 0, read = 0, total = 0;
  for (const r of state.rows.values()) {
    if (r.side) continue;
    n++;
    read += r.cache_read_tokens || 0;
    total += (r.cache_read_tokens || 0) + (r.cache_write_tokens || 0) + (r.input_tokens || 0);
  }
  const rate = total ? ` · cache hit rate ${((100 * read) / total).toFixed(1)}%` : "";
  document.getElementById("stats").textContent = `${n} exchanges${state.inflight.size ? ` · ${state.inflight.size} in flight` : ""}${rate}`;
}

// ---------------------------------------------------------------- list

// Choices of a filter named in state.vocabulary come from the server's enums
// (/api/vocabulary), never restated here.
const FILTERS = [
  ["conversation", "conversation"],
  ["provider", "provider", "providers"],
  ["model", "model"],
  ["outcome", "outcome", "outcomes"],
  ["status", "status", ["", "2xx", "4xx", "5xx", "none"]],
  ["tag", "tag"],
  ["rule", "rule fired"],
  ["verdict", "cache", "verdicts"],
  ["since", "since"],
  ["until", "until"],
];

function matches(r) {
  const f = state.filters;
  if (!state.showSide && r.side) return false;
  if (state.searchIds && !state.searchIds.has(r.id)) return false;
  if (f.conversation && !(r.conversation || "").startsWith(f.conversation)) return false;
  if (f.provider && r.provider !== f.provider) return false;
  if (f.model && !globMatch(f.model, r.model || "")) return false;
  if (f.outcome && r.outcome !== f.outcome) return false;
  if (f.status) {
    const s = r.status;
    const cls = s ? `${String(s)[0]}xx` : "none";
    if (cls !== f.status) return false;
  }
  if (f.tag && !(r.tags || []).includes(f.tag)) return false;
  if (f.rule && !(r.rules || []).includes(f.rule)) return false;
  if (f.verdict && !(r.cache || "").toLowerCase().startsWith(f.verdict)) return false;
  if (f.since && r.started_ms < timeBound(f.since)) return false;
  if (f.until && r.started_ms >= timeBound(f.until)) return false;
  return true;
}

function globMatch(pattern, text) {
  if (!pattern.includes("*")) return text.includes(pattern);
  const re = new RegExp(`^${pattern.split("*").map((p) => p.replace(/[.+?^${}()|[\]\\]/g, "\\$&")).join(".*")}$`);
  return re.test(text);
}

// "10m", "2h", "3d" ago, or a date the browser can parse.
function timeBound(text) {
  const m = /^(\d+)([smhd])$/.exec(text.trim());
  if (m) return Date.now() - Number(m[1]) * { s: 1e3, m: 6e4, h: 36e5, d: 864e5 }[m[2]];
  const t = Date.parse(text);
  return Number.isNaN(t) ? 0 : t;
}

function filterBar() {
  const bar = el("div", { id: "filters" });
  for (const [key, label, choices] of FILTERS) {
    const options = typeof choices === "string" ? ["", ...((state.vocabulary || {})[choices] || [])] : choices;
    const value = state.filters[key] || "";
    const onchange = (e) => {
      state.filters[key] = e.target.value.trim();
      writeHash();
      renderList();
    };
    const input = options
      ? el("select", { id: `filter-${key}`, onchange }, options.map((o) => el("option", { value: o, selected: o === value, text: o || `${label}: any` })))
      : el("input", { id: `filter-${key}`, placeholder: label, value, onchange });
    bar.append(input);
  }
  const search = el("input", { id: "search", type: "search", placeholder: "search bodies (/)", value: state.filters.q || "" });
  // Applies as one types, once the typing pauses; Enter (change) applies at once.
  let typing = null;
  search.addEventListener("input", () => {
    clearTimeout(typing);
    typing = setTimeout(() => runSearch(search.value.trim()), 300);
  });
  search.addEventListener("change", () => {
    clearTimeout(typing);
    if (search.value.trim() !== (state.filters.q || "")) runSearch(search.value.trim());
  });
  bar.append(search);
  const side = el("input", { type: "checkbox", id: "show-side", checked: state.showSide });
  side.addEventListener("change", () => {
    state.showSide = side.checked;
    renderList();
  });
  bar.append(el("label", {}, side, "side requests"));
  return bar;
}

async function runSearch(q) {
  state.filters.q = q;
  writeHash();
  if (!q) {
    state.searchIds = null;
    renderList();
    return;
  }
  try {
    const found = await api(`/api/captures?all=1&grep=${encodeURIComponent(q)}`);
    state.searchIds = new Set(found.captures.map((r) => r.id));
  } catch (e) {
    state.searchIds = new Set();
    showError(e);
  }
  renderList();
}

function writeHash() {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(state.filters)) if (v) q.set(k, v);
  const text = q.toString();
  history.replaceState(null, "", text ? `#/?${text}` : "#/");
}

let listEl = null;
function showList(params) {
  navActive("list");
  state.filters = Object.fromEntries(params.entries());
  const head = el("div", { id: "list-head", class: "grid" },
    el("span", { text: "time" }), el("span", { text: "conversation" }), el("span", { text: "model" }),
    el("span", { text: "status" }), el("span", { class: "num", text: "input" }), el("span", { class: "num", text: "cache rd" }),
    el("span", { class: "num", text: "cache wr" }), el("span", { class: "num", text: "output" }), el("span", { class: "num", text: "cost" }), el("span", { text: "cache" }),
    el("span", { text: "rules" }), el("span", { text: "tags" }));
  listEl = el("div", { id: "list", tabindex: "0" }, el("div", { id: "list-spacer" }, el("div", { id: "list-rows" })));
  listEl.addEventListener("scroll", () => paintRows());
  setMain(filterBar(), head, listEl);
  if (state.filters.q) runSearch(state.filters.q);
  else renderList();
  listEl.focus();
}

function renderList() {
  if (currentView !== "list" || !listEl) return;
  const inflight = [...state.inflight.values()]
    .filter((f) => !state.rows.has(f.started.id) && (state.showSide || !f.started.side))
    .sort((a, b) => b.started.started_ms - a.started.started_ms)
    .map((f) => f.started.id);
  state.visible = inflight.concat(state.order.filter((id) => matches(state.rows.get(id))));
  state.selected = Math.min(state.selected, Math.max(0, state.visible.length - 1));
  document.getElementById("list-spacer").style.height = `${state.visible.length * ROW}px`;
  paintRows();
  updateStats();
  // For bench/viewer: the first paint of a list with rows in it.
  if (state.visible.length && !performance.getEntriesByName("promptgate:first-rows").length) {
    performance.mark("promptgate:first-rows");
  }
  if (!state.visible.length) {
    document.getElementById("list-rows").replaceChildren(el("p", { class: "empty", text: state.rows.size ? "No exchange matches these filters." : "No exchanges yet: point an agent at promptgate and they appear here." }));
  }
}

// Virtual scrolling: only the rows in view (and a few around) are in the DOM.
function paintRows() {
  if (!listEl) return;
  const first = Math.max(0, Math.floor(listEl.scrollTop / ROW) - 10);
  const count = Math.ceil(listEl.clientHeight / ROW) + 20;
  const rowsEl = document.getElementById("list-rows");
  rowsEl.style.transform = `translateY(${first * ROW}px)`;
  const nodes = [];
  for (let i = first; i < Math.min(state.visible.length, first + count); i++) nodes.push(rowNode(state.visible[i], i));
  rowsEl.replaceChildren(...nodes);
}

function rowNode(id, index) {
  const r = state.rows.get(id);
  const open = () => (location.hash = `#/x/${id}`);
  if (!r) {
    const f = state.inflight.get(id);
    const s = f.started, p = f.progress;
    const text = p ? (p.text || "").slice(-120).replace(/\s+/g, " ") : "";
    return el("div", { class: `row grid inflight${index === state.selected ? " selected" : ""}`, "data-id": id, onclick: open },
      el("span", { text: fmtTime(s.started_ms) }), el("span", { text: "" }), el("span", { text: s.model || s.path || "" }),
      el("span", { class: p && p.stalled_ms ? "stalled" : "", text: p ? (p.stalled_ms ? `${p.status || ""} stalled ${Math.round(p.stalled_ms / 1000)}s` : `${p.status || ""} streaming`) : "sent" }), el("span", { class: "num", text: "" }),
      el("span", { class: "num", text: "" }), el("span", { class: "num", text: "" }), el("span", { class: "num", text: p ? fmtBytes(p.bytes) : "" }),
      // The answer so far runs across the cache, rules and tags columns: none is known yet.
      el("span", { class: "num", text: "" }), el("span", { class: "live-text", title: "the answer so far", text }));
  }
  return el("div", { class: `row grid${index === state.selected ? " selected" : ""}`, "data-id": id, onclick: open },
    el("span", { text: fmtTime(r.started_ms) }),
    el("span", { class: "mono", title: r.conversation || "", text: shortConv(r.conversation) }),
    el("span", { text: r.model || r.path || "" }),
    el("span", { text: `${r.status || "—"} ${r.outcome}` }),
    el("span", { class: "num", text: fmtNum(r.input_tokens) }),
    el("span", { class: "num", text: fmtNum(r.cache_read_tokens) }),
    el("span", { class: "num", text: fmtNum(r.cache_write_tokens) }),
    el("span", { class: "num", text: fmtNum(r.output_tokens) }),
    el("span", { class: "num cost", text: r.cost_usd === null || r.cost_usd === undefined ? "" : fmtUsd(r.cost_usd) }),
    el("span", {}, r.cache ? el("span", { class: `badge ${verdictClass(r.cache)}`, text: r.cache }) : ""),
    el("span", { text: (r.rules || []).join(", ") }),
    el("span", {}, (r.tags || []).map((t) => el("span", { class: "badge", text: t }))));
}

function moveSelection(delta) {
  if (!state.visible.length) return;
  state.selected = Math.max(0, Math.min(state.visible.length - 1, state.selected + delta));
  const top = state.selected * ROW;
  if (top < listEl.scrollTop) listEl.scrollTop = top;
  else if (top + ROW > listEl.scrollTop + listEl.clientHeight) listEl.scrollTop = top + ROW - listEl.clientHeight;
  paintRows();
}

// ---------------------------------------------------------------- exchange

async function showExchange(id) {
  navActive("list");
  setMain(el("div", { class: "page", id: "exchange" }, el("p", { class: "empty", text: "Loading…" })));
  let record;
  try {
    record = await api(`/api/captures/${encodeURIComponent(id)}`);
  } catch (e) {
    if (state.inflight.has(id)) return renderInflight(id);
    return showError(e);
  }
  const [prompt, previous, edits, anatomy] = await Promise.all([
    api(`/api/captures/${record.id}/prompt`).catch(() => null),
    api(`/api/captures/${record.id}/previous`).catch(() => ({})),
    record.request.sent_body ? api(`/api/captures/${record.id}/edits`).catch(() => null) : null,
    api(`/api/captures/${record.id}/anatomy`).catch(() => null),
  ]);
  if (currentId !== id) return;
  const page = el("div", { class: "page", id: "exchange", "data-id": record.id });
  page.append(exchangeHeader(record, previous.previous));
  page.append(cacheSection(record, prompt && prompt.cache));
  if (anatomy) page.append(anatomySection(anatomy));
  const promptBox = el("div", { id: "prompt" });
  const raw = el("pre", { id: "raw-json", hidden: true, text: JSON.stringify(record, null, 2) });
  const tabs = el("div", { class: "tabs" });
  const promptTab = el("button", { class: "on", text: "Prompt" });
  const rawTab = el("button", { id: "raw-toggle", text: "Raw JSON" });
  promptTab.addEventListener("click", () => { promptBox.hidden = false; raw.hidden = true; promptTab.className = "on"; rawTab.className = ""; });
  rawTab.addEventListener("click", () => { promptBox.hidden = true; raw.hidden = false; rawTab.className = "on"; promptTab.className = ""; });
  tabs.append(promptTab, rawTab);
  page.append(el("h3", { text: "Request" }), tabs, el("div", { class: "section" }, promptBox, raw));
  if (prompt) {
    renderPrompt(promptBox, prompt.view);
    if (anatomy) labelUnits(promptBox, anatomy);
  } else promptBox.append(el("p", { class: "empty", text: "No prompt model for this body." }));
  page.append(rulesSection(record, edits));
  page.append(responseSection(record));
  page.append(headersSection(record));
  setMain(page);
}

// A WebSocket turn: its socket, and where its whole prompt came from (or why not).
function socketTurn(ws) {
  const link = (id) => el("a", { href: `#/x/${id}`, text: id.slice(-8) });
  const out = ["a turn of socket ", link(ws.socket), ` (${ws.frame.size} bytes as sent); `];
  if (ws.missing) out.push(`the prompt is the message's only: ${ws.missing}`);
  else if (!ws.recovered_from.length) out.push("the prompt is the message's own");
  else {
    out.push(`the prompt is put back together from ${ws.recovered_from.length} earlier turn(s): `);
    ws.recovered_from.forEach((id, i) => out.push(...(i ? [", "] : []), link(id)));
  }
  return out;
}

function exchangeHeader(r, previous) {
  const id = r.id;
  const curl = el("pre", { id: "curl", hidden: true });
  const curlButton = el("button", { text: "curl" });
  curlButton.addEventListener("click", async () => {
    const c = await api(`/api/captures/${id}/curl`);
    curl.textContent = `# save the body first: ${location.origin}/api/captures/${id}/body\n${c.command}`;
    curl.hidden = !curl.hidden;
  });
  const conv = r.conversation ? el("a", { href: `#/c/${encodeURIComponent(r.conversation)}`, text: r.conversation }) : "—";
  return el("div", {},
    el("h2", {}, `${r.method} ${r.path} `, el("span", { class: `badge ${r.outcome === "ok" ? "ok" : "bad"}`, text: `${r.response.status || "—"} ${r.outcome}` })),
    el("dl", { class: "meta" },
      el("dt", { text: "id" }), el("dd", { class: "mono", text: id }),
      el("dt", { text: "started" }), el("dd", { text: `${r.started_at} (${r.times.total_ms.toFixed(0)} ms)` }),
      el("dt", { text: "model" }), el("dd", { text: r.model || "—" }),
      el("dt", { text: "conversation" }), el("dd", {}, conv),
      el("dt", { text: "mode" }), el("dd", { text: `${r.mode}${r.host ? ` · ${r.host}` : ""}` }),
      r.error ? [el("dt", { text: "error" }), el("dd", { class: "error", text: r.error })] : null,
      r.repeat_of ? [el("dt", { text: "repeat of" }), el("dd", {}, el("a", { href: `#/x/${r.repeat_of}`, text: r.repeat_of }))] : null,
      r.websocket ? [el("dt", { text: "websocket" }), el("dd", { id: "websocket-turn" }, ...socketTurn(r.websocket))] : null),
    el("div", { class: "actions" },
      previous ? el("a", { id: "diff-previous", href: `#/d/${previous}/${id}`, text: "diff against previous turn" }) : null,
      el("a", { href: `/api/captures/${id}`, download: `${id}.json`, text: "record JSON" }),
      el("a", { href: `/api/captures/${id}/har`, download: `${id}.har`, text: "HAR" }),
      el("a", { href: `/api/captures/${id}/body`, download: `${id}.json`, text: "body" }),
      curlButton),
    curl);
}

// The families' colours are the stylesheet's (`.family-NAME`): bars and legend agree,
// and none is a cache colour (read, write, uncached) the charts beside them use.
function familyLegend(families) {
  return el("div", { class: "legend" }, families.map((f) => el("span", {}, el("i", { class: `family-${f}` }), f)));
}

// The prompt's anatomy: a bar of its families by tokens, then each part with how
// the provider billed it (read from the cache, written, uncached) and its dollars.
function anatomySection(a) {
  const box = el("div", { class: "section", id: "anatomy" });
  const total = a.families.reduce((n, f) => n + f.tokens, 0) || 1;
  const width = 560;
  const bar = svg("svg", { width: String(width), height: "16", role: "img", "aria-label": "tokens per family" });
  let x = 0;
  for (const f of a.families) {
    const w = (f.tokens / total) * width;
    const rect = svg("rect", { x: String(x), y: "0", width: String(w), height: "16", class: `family-${f.family}` });
    const title = svg("title", {});
    title.textContent = `${f.family}: ${f.tokens} tokens`;
    rect.append(title);
    bar.append(rect);
    x += w;
  }
  const legend = el("div", { class: "legend" }, a.families.map((f) => el("span", {}, el("i", { class: `family-${f.family}` }),
    `${f.family} ${fmtNum(f.tokens)} (${((100 * f.tokens) / total).toFixed(0)} %)${f.usd !== undefined && f.usd !== null ? ` ${fmtUsd(f.usd)}` : ""}`)));
  const table = el("table", { class: "turns" }, el("tr", {}, ["family", "part", "unit", "tokens", "billed", "cost"].map((h) => el("th", { text: h }))));
  for (const p of a.parts) {
    const b = p.billed;
    const how = !b ? "" : b.tokens === 0 ? "—" : b.read === b.tokens ? "cached" : b.write === b.tokens ? "written" : b.uncached === b.tokens ? "uncached" : "split";
    table.append(el("tr", { class: p.cached ? "cached" : "" },
      el("td", { text: p.family }), el("td", { text: p.name }), el("td", { class: "mono" }, unitLink(p.unit)),
      el("td", { class: "num", text: fmtNum(b ? b.tokens : p.tokens) }), el("td", { text: how }),
      el("td", { class: "num", text: b && b.usd !== undefined && b.usd !== null ? fmtUsd(b.usd) : "" })));
  }
  const head = `Prompt anatomy (${a.agent}): ${fmtNum(a.provider_input_tokens ?? a.estimated_tokens)} tokens` + (a.input_usd !== undefined && a.input_usd !== null ? `, input ${fmtUsd(a.input_usd)}` : "");
  box.append(el("h3", { text: head }), bar, legend);
  const advice = adviceList(a.advice);
  if (advice) box.append(advice);
  box.append(el("details", {}, el("summary", { text: `${a.parts.length} parts` }), table));
  return box;
}

// What the anatomy's numbers call for, one line each (nothing when none).
function adviceList(advice) {
  if (!advice || !advice.length) return null;
  return el("ul", { class: "advice" }, advice.map((x) => el("li", { "data-kind": x.kind, text: x.text })));
}

// A unit's path that scrolls the prompt view to it.
function unitLink(path) {
  const a = el("a", { href: "#", class: "unit-link", text: path });
  a.addEventListener("click", (e) => {
    e.preventDefault();
    const node = document.querySelector(`#prompt .unit[data-path="${CSS.escape(path)}"]`);
    if (node) { node.scrollIntoView({ block: "center" }); node.classList.add("flash"); setTimeout(() => node.classList.remove("flash"), 1200); }
  });
  return a;
}

// The prompt view's units gain their parts' family labels (a unit may hold several).
function labelUnits(promptBox, a) {
  const byUnit = new Map();
  for (const p of a.parts) {
    if (!byUnit.has(p.unit)) byUnit.set(p.unit, []);
    byUnit.get(p.unit).push(p);
  }
  for (const [path, parts] of byUnit) {
    // A tool's head is its summary line; other units have a head row.
    const node = promptBox.querySelector(`.unit[data-path="${CSS.escape(path)}"]`);
    const head = node && (node.querySelector(":scope > .head") || node.querySelector(":scope > details > summary"));
    if (!head) continue;
    const seen = new Set();
    for (const p of parts) {
      const key = `${p.family}: ${p.name}`;
      if (seen.has(key)) continue;
      seen.add(key);
      head.prepend(el("span", { class: `family-label family-${p.family}`, title: key, text: p.family === "conversation" ? p.name : `${p.family} · ${p.name}` }));
    }
  }
}

function cacheSection(r, told) {
  const c = r.cache;
  const box = el("div", { class: "section", id: "cache" });
  if (!c) {
    box.append(el("span", { class: "empty", text: "No cache analysis for this exchange." }));
    return box;
  }
  const u = r.usage || {};
  box.append(
    el("div", {}, el("span", { class: `badge ${verdictClass(c.verdict)}`, text: c.verdict }), " ", told && told.reason ? told.reason : reasonText(c.reason)),
    el("div", { class: "mono" },
      `read ${c.actual.read} · write ${c.actual.write} · uncached ${c.actual.input} · predicted read ${c.prediction.read_tokens}` +
        (c.prediction.read_through ? ` through ${c.prediction.read_through}` : "") +
        (c.lost_tokens ? ` · lost ${c.lost_tokens}` : "") +
        (c.cost ? ` · total ${fmtUsd(c.cost.total_usd ?? c.cost.input_usd)} (input ${fmtUsd(c.cost.input_usd)}, output ${fmtUsd(c.cost.output_usd ?? 0)}), lost ${fmtUsd(c.cost.lost_usd)}` : " · cost unknown (no price for this model)") +
        (u.output_tokens !== undefined ? ` · output ${u.output_tokens}` : "")));
  // DOM append writes a null as the text "null": only a fix there is appended.
  if (c.fix) box.append(el("div", { class: "fix", id: "cache-fix", text: `fix: ${c.fix}` }));
  const says = c.provider_says;
  if (says) {
    const judged = says.agrees === true ? ": agrees" : says.agrees === false ? `: disagrees, ${says.note || ""}` : "";
    const missed = says.missed_tokens ? ` (${says.missed_tokens} tokens missed)` : "";
    box.append(el("div", { class: "mono", id: "cache-provider", text: `provider says ${says.reason}${missed}${judged}` }));
  }
  if (c.respelled && c.respelled.length) {
    box.append(el("div", { class: "mono", id: "cache-respelled", text: `re-spelled ${c.respelled.join(", ")}: other bytes, the same JSON value (compared as values, as the provider does)` }));
  }
  return box;
}

function reasonText(reason) {
  if (!reason) return "";
  if (typeof reason === "string") return reason;
  const kind = Object.keys(reason)[0];
  const v = reason[kind];
  if (v && typeof v === "object" && v.unit) return `${kind.replace(/_/g, " ")}: ${v.unit}${v.offset !== undefined ? ` @${v.offset}` : ""}`;
  return `${kind.replace(/_/g, " ")} ${JSON.stringify(v)}`;
}

// The prompt as the model sees it: tools, system blocks, messages, breakpoints,
// and the prefix the provider read from cache shaded.
function renderPrompt(box, view) {
  if (view.settings.length) {
    box.append(el("div", { class: "mono", id: "settings" }, view.settings.map(([k, v]) => `${k}=${v.length > 80 ? `…(${v.length} bytes)` : v}`).join("  ")));
  }
  if (view.automatic) box.append(el("div", { class: "breakpoint", text: `automatic caching · ttl ${view.automatic}` }));
  const units = view.units;
  const lastCached = units.map((u) => u.cached).lastIndexOf(true);
  let region = null, message = null, tools = null, holder = box;
  units.forEach((u, i) => {
    if (u.region !== region) {
      region = u.region;
      message = null;
      const section = el("div", { class: `region region-${region}` }, el("h3", { text: region === "tools" ? `tools (${units.filter((x) => x.region === "tools").length})` : region }));
      box.append(section);
      holder = section;
      tools = region === "tools" ? section : null;
    }
    if (u.message !== undefined && u.message !== message) {
      message = u.message;
      const role = u.role || "?";
      const m = el("div", { class: "message", "data-message": String(message) },
        el("div", { class: "role" }, `messages[${message}] `, el("span", { class: `badge${role === "system" || role === "developer" ? " system-role" : ""}`, text: role === "system" ? "role: system" : role })));
      (tools || box.lastChild).append(m);
      holder = m;
    }
    holder.append(unitNode(u));
    if (u.breakpoint) holder.append(el("div", { class: "breakpoint", "data-after": u.path, text: `◆ breakpoint ${u.breakpoint[0]} after ${u.path} · ttl ${u.breakpoint[1]}` }));
    if (i === lastCached) holder.append(el("div", { class: "cache-end", text: `▲ read from cache through ${u.path}` }));
  });
  if (!units.length) box.append(el("p", { class: "empty", text: "Not a prompt promptgate reads (another API)." }));
}

function unitNode(u) {
  const node = el("div", { class: `unit${u.cached ? " cached" : ""}`, "data-path": u.path, "data-kind": u.kind });
  const badges = [el("span", { class: "badge", text: u.kind })];
  if (u.reminder) badges.push(el("span", { class: "badge reminder", text: "system-reminder" }));
  if (u.error) badges.push(el("span", { class: "badge bad", text: "error" }));
  if (u.region === "tools") {
    const d = el("details", {}, el("summary", {}, el("b", { text: u.name || "?" }), ` (${fmtBytes(u.bytes)})`), el("pre", { text: pretty(u.json) }));
    node.append(d);
    return node;
  }
  node.append(el("div", { class: "head" }, badges, u.path, u.name ? ` · ${u.name}` : "", ` · ${fmtBytes(u.bytes)}`));
  if (["image", "document"].includes(u.kind)) node.append(el("pre", { text: `[${u.kind}, ${fmtBytes(u.bytes)}]` }));
  else if (u.kind === "redacted_thinking") node.append(el("pre", { text: `[redacted thinking, ${fmtBytes(u.bytes)}]` }));
  else if (u.kind === "thinking") node.append(el("pre", { text: u.text ? u.text : "(thinking omitted: only its signature was sent)" }));
  else if (u.kind === "tool_use" || u.kind === "function_call") node.append(el("pre", { text: pretty(u.json) }));
  else if (u.text !== undefined) node.append(el("pre", { text: u.text }));
  else if (u.json) node.append(el("pre", { text: pretty(u.json) }));
  return node;
}

function pretty(json) {
  try {
    return JSON.stringify(JSON.parse(json), null, 2);
  } catch {
    return json || "";
  }
}

function rulesSection(r, edits) {
  const box = el("div", { class: "section", id: "rules-fired" });
  box.append(el("h3", { text: "Rules" }));
  box.append(el("div", {}, r.rules_fired.length ? `fired: ${r.rules_fired.join(", ")}` : "no rule fired", r.tags.length ? " · tags: " : "", r.tags.map((t) => el("span", { class: "badge", text: t }))));
  if (r.body_diff.length) box.append(el("div", { class: "mono", text: `changed: ${r.body_diff.join(", ")}` }));
  // Each policy's turn (the rules as one, each hook by name): what it decided, how long it took.
  for (const p of r.policies || []) {
    box.append(el("div", { class: "mono policy-run", text: `${p.phase} · ${p.policy}: ${p.decision} (${p.took_us} µs)` }));
  }
  // What the outgoing-secrets scanner found: detector, kind, where, what was done (never the value).
  for (const f of r.findings || []) {
    box.append(el("div", { class: "mono finding", text: `found ${f.detector} (${f.kind}) at ${f.location}: ${f.action}${f.scan ? ` by ${f.scan}` : ""}` }));
  }
  if (edits && edits.entries.length) {
    box.append(el("div", { class: "empty", text: "received → sent" }));
    for (const e of edits.entries) box.append(diffEntry(e, false));
  }
  return box;
}

function responseSection(r) {
  const res = r.response;
  const box = el("div", { class: "section", id: "response" });
  box.append(el("h3", { text: "Response" }));
  const usage = r.usage ? Object.entries(r.usage).filter(([, v]) => v !== null).map(([k, v]) => `${k} ${v}`).join(" · ") : "";
  box.append(el("div", { class: "mono" }, `status ${res.status ?? "—"} · ${res.format || "—"}${res.stop_reason ? ` · stop ${res.stop_reason}` : ""}${res.format === "sse" ? ` · ${res.event_count} events${res.complete ? "" : " (incomplete)"}` : ""}${usage ? ` · ${usage}` : ""}`));
  if (res.parse_error) box.append(el("div", { class: "error", text: res.parse_error }));
  for (const e of res.edits || []) box.append(el("div", { class: "mono", text: `stream edit: ${JSON.stringify(e)}` }));
  const message = res.message?.content ?? (res.body?.json ? res.body.content : null);
  const blocks = answerBlocks(message);
  if (blocks.length) for (const b of blocks) box.append(b);
  else if (res.body?.content !== undefined) box.append(el("pre", { text: typeof res.body.content === "string" ? res.body.content : JSON.stringify(res.body.content, null, 2) }));
  return box;
}

// The reassembled answer, in any of the three formats.
function answerBlocks(m) {
  if (!m || typeof m !== "object") return [];
  const out = [];
  const text = (t) => out.push(el("pre", { class: "answer-text", text: t }));
  const call = (name, input) => out.push(el("div", { class: "unit" }, el("div", { class: "head" }, el("span", { class: "badge", text: "tool_use" }), name), el("pre", { text: typeof input === "string" ? pretty(input) : JSON.stringify(input, null, 2) })));
  if (Array.isArray(m.content)) {
    for (const b of m.content) {
      if (b.type === "text") text(b.text);
      else if (b.type === "tool_use") call(b.name, b.input);
      else if (b.type === "thinking") out.push(el("pre", { class: "empty", text: b.thinking || "(thinking omitted)" }));
      else out.push(el("pre", { text: JSON.stringify(b, null, 2) }));
    }
  } else if (Array.isArray(m.choices)) {
    for (const c of m.choices) {
      const msg = c.message || c.delta || {};
      if (msg.content) text(msg.content);
      for (const t of msg.tool_calls || []) call(t.function?.name, t.function?.arguments);
    }
  } else if (Array.isArray(m.output)) {
    for (const item of m.output) {
      if (item.type === "message") for (const c of item.content || []) text(c.text || "");
      else if (item.type === "function_call") call(item.name, item.arguments);
    }
  }
  return out;
}

function headersSection(r) {
  const table = (rows) => el("table", { class: "kv" }, rows.map(([k, v]) => el("tr", {}, el("td", { text: k }), el("td", { text: v }))));
  return el("div", { class: "section", id: "headers" },
    el("h3", { text: "Headers (redacted)" }),
    el("details", {}, el("summary", { text: `received (${r.request.headers.length})` }), table(r.request.headers)),
    el("details", {}, el("summary", { text: `sent upstream (${r.request.sent_headers.length})` }), table(r.request.sent_headers)),
    el("details", {}, el("summary", { text: `response (${r.response.headers.length})` }), table(r.response.headers)));
}

// An exchange still in flight: what the live feed says so far.
function renderInflight(id) {
  const f = state.inflight.get(id);
  if (!f) return;
  let page = document.getElementById("exchange");
  if (!page || page.dataset.inflight !== id) {
    page = el("div", { class: "page", id: "exchange", "data-inflight": id },
      el("h2", { text: `${f.started.method || ""} ${f.started.path || ""} · in flight` }),
      el("div", { class: "mono", id: "inflight-meta" }),
      el("div", { class: "section" }, el("pre", { class: "live-text", id: "inflight-text" })));
    setMain(page);
  }
  const p = f.progress;
  document.getElementById("inflight-meta").textContent = `${f.started.model || ""} · ${p ? `status ${p.status} · ${fmtBytes(p.bytes)}${p.stalled_ms ? ` · stalled: no data for ${Math.round(p.stalled_ms / 1000)}s` : ""}` : "waiting for the response"}`;
  document.getElementById("inflight-text").textContent = p ? p.text : "";
}

// ---------------------------------------------------------------- diff

async function showDiff(a, b) {
  navActive("list");
  const page = el("div", { class: "page", id: "diff" }, el("p", { class: "empty", text: "Loading…" }));
  setMain(page);
  let diff, rb;
  try {
    [diff, rb] = await Promise.all([api(`/api/captures/${a}/diff/${b}`), api(`/api/captures/${b}`)]);
  } catch (e) {
    return showError(e);
  }
  const picker = el("select", { id: "diff-against" });
  const others = rb.conversation ? state.order.filter((id) => state.rows.get(id)?.conversation === rb.conversation && id !== b) : [];
  // The exchange diffed is always offered and chosen, even when the list lacks it.
  if (!others.includes(diff.a)) others.unshift(diff.a);
  for (const id of others) {
    const row = state.rows.get(id);
    picker.append(el("option", { value: id, text: row ? `${fmtTime(row.started_ms)} ${id}` : id }));
  }
  picker.value = diff.a;
  picker.addEventListener("change", () => (location.hash = `#/d/${picker.value}/${b}`));
  const other = el("input", { id: "diff-other", placeholder: "or any exchange id", size: "30" });
  other.addEventListener("change", () => other.value.trim() && (location.hash = `#/d/${encodeURIComponent(other.value.trim())}/${b}`));
  const changed = diff.entries.filter((e) => e.change !== "same").length;
  page.replaceChildren(
    el("h2", {}, "diff ", el("a", { href: `#/x/${diff.a}`, class: "mono", text: diff.a }), " → ", el("a", { href: `#/x/${diff.b}`, class: "mono", text: diff.b })),
    el("div", { class: "actions" }, el("label", {}, "against ", picker), other, el("span", { text: `${changed} of ${diff.entries.length} units differ, in cache order` })));
  diff.entries.forEach((e, i) => page.append(diffEntry(e, i === diff.breaks_prefix)));
}

function diffEntry(e, breaks) {
  const node = el("div", { class: `entry ${e.change}${breaks ? " breaks" : ""}`, "data-section": e.section, "data-b": e.b ?? "", "data-change": e.change });
  const where = e.b !== undefined && e.b !== null ? `${e.section}[${e.b}]` : `${e.section}[${e.a}] (first)`;
  node.append(el("div", {}, el("span", { class: "badge", text: e.change }), el("span", { class: "label", text: `${where} ${e.label}` }), breaks ? el("span", { class: "break-mark", text: "⟂ the cached prefix breaks here" }) : null));
  if (e.change === "changed") {
    const [before, after] = charDiff(e.before || "", e.after || "");
    node.append(el("div", { class: "side" }, el("pre", { class: "before" }, before), el("pre", { class: "after" }, after)));
  } else if (e.change === "added" && e.after !== undefined) node.append(el("pre", { text: clip(e.after) }));
  else if (e.change === "removed" && e.before !== undefined) node.append(el("pre", { text: clip(e.before) }));
  return node;
}

const clip = (t) => (t.length > 4000 ? `${t.slice(0, 4000)}… (${t.length} chars)` : t);

// Character-level marks: line by line, then within each changed line pair the
// characters between the common start and end.
function charDiff(a, b) {
  const before = [], after = [];
  const xs = a.split("\n"), ys = b.split("\n");
  let i = 0, j = 0;
  while (i < xs.length || j < ys.length) {
    if (i < xs.length && j < ys.length && xs[i] === ys[j]) {
      before.push(`${xs[i]}\n`);
      after.push(`${ys[j]}\n`);
      i++, j++;
      continue;
    }
    // Lines only one side has: look a little ahead for the other side's line.
    const jAhead = ys.indexOf(xs[i], j), iAhead = xs.indexOf(ys[j], i);
    if (i < xs.length && j < ys.length && (jAhead < 0 || jAhead - j > 20) && (iAhead < 0 || iAhead - i > 20)) {
      const [x, y] = inline(xs[i], ys[j]);
      before.push(...x, "\n");
      after.push(...y, "\n");
      i++, j++;
    } else if (j < ys.length && (i >= xs.length || (jAhead >= 0 && (iAhead < 0 || jAhead - j <= iAhead - i)))) {
      after.push(el("ins", { text: `${ys[j]}\n` }));
      j++;
    } else {
      before.push(el("del", { text: `${xs[i]}\n` }));
      i++;
    }
  }
  return [before, after];
}

function inline(x, y) {
  let p = 0;
  while (p < x.length && p < y.length && x[p] === y[p]) p++;
  let s = 0;
  while (s < x.length - p && s < y.length - p && x[x.length - 1 - s] === y[y.length - 1 - s]) s++;
  return [
    [x.slice(0, p), el("del", { text: x.slice(p, x.length - s) }), x.slice(x.length - s)],
    [y.slice(0, p), el("ins", { text: y.slice(p, y.length - s) }), y.slice(y.length - s)],
  ];
}

// ---------------------------------------------------------------- conversations

async function showConversations() {
  navActive("conversations");
  const page = el("div", { class: "page", id: "conversations" });
  setMain(page);
  const { conversations } = await api("/api/conversations");
  const table = el("table", { class: "turns", id: "conversation-list" }, el("tr", {}, ["conversation", "first prompt", "requests", "tokens in", "out", "hit", "input $", "total $", "first", "last", "models"].map((h) => el("th", { text: h }))));
  for (const c of conversations.slice().reverse()) {
    const prompt = c.input_tokens + c.cache_read_tokens + c.cache_write_tokens;
    table.append(el("tr", { "data-conversation": c.conversation || "" },
      el("td", {}, c.conversation ? el("a", { href: `#/c/${encodeURIComponent(c.conversation)}`, class: "mono", text: c.conversation }) : "—"),
      el("td", { class: "preview", text: c.first_prompt || "" }),
      el("td", { class: "num", text: c.requests }),
      el("td", { class: "num tokens", text: fmtNum(prompt) }),
      el("td", { class: "num", text: fmtNum(c.output_tokens) }),
      el("td", { class: "num hit", text: c.hit_rate === undefined ? "—" : `${Math.round(c.hit_rate * 100)}%` }),
      el("td", { class: "num cost", text: fmtUsd(c.input_usd) }),
      el("td", { class: "num total", text: fmtUsd(c.total_usd) }),
      el("td", { text: c.first_ms ? fmtTime(c.first_ms) : "" }),
      el("td", { text: c.last_ms ? fmtTime(c.last_ms) : "" }),
      el("td", { text: (c.models || []).join(", ") })));
  }
  page.append(el("h2", { text: `${conversations.length} conversations` }), table);
}

async function showConversation(key) {
  navActive("conversations");
  const page = el("div", { class: "page", id: "conversation" }, el("p", { class: "empty", text: "Loading…" }));
  setMain(page);
  let report;
  try {
    report = await api(`/api/cache/report?conversation=${encodeURIComponent(key)}`);
  } catch (e) {
    return showError(e);
  }
  const conv = report.conversations.find((c) => c.conversation === key) || report.conversations[0];
  if (!conv) return page.replaceChildren(el("p", { class: "empty", text: "No analysed turns in this conversation." }));
  const s = conv.summary;
  const max = Math.max(1, ...conv.timeline.map((t) => t.read + t.write + t.uncached));
  const chart = el("div", { id: "chart" });
  const width = 560, barH = 16, gap = 6;
  const plot = svg("svg", { width: String(width + 60), height: String(conv.timeline.length * (barH + gap) + 4), role: "img", "aria-label": "tokens per turn" });
  conv.timeline.forEach((t, i) => {
    let x = 0;
    for (const [part, n] of [["read", t.read], ["write", t.write], ["uncached", t.uncached]]) {
      const w = (n / max) * width;
      const rect = svg("rect", { x: String(x), y: String(i * (barH + gap)), width: String(w), height: String(barH), class: `seg-${part}`, fill: { read: "#4c9f70", write: "#e8a33d", uncached: "#8c96a8" }[part] });
      const title = svg("title", {});
      title.textContent = `turn ${i + 1}: ${part} ${n}`;
      rect.append(title);
      plot.append(rect);
      x += w;
    }
    const label = svg("text", { x: String(x + 4), y: String(i * (barH + gap) + barH - 3), "font-size": "11", fill: "#69707d" });
    const total = t.read + t.write + t.uncached;
    label.textContent = total ? `${((100 * t.read) / total).toFixed(0)}%` : "";
    plot.append(label);
  });
  chart.append(el("div", { class: "legend" }, el("span", {}, el("i", { class: "read" }), "cache read"), el("span", {}, el("i", { class: "write" }), "cache write"), el("span", {}, el("i", { class: "uncached" }), "uncached input")), plot);
  const table = el("table", { class: "turns", id: "turns" }, el("tr", {}, ["turn", "time", "model", "verdict", "read", "write", "uncached", "hit", "input $", "total $", "lost $", "why"].map((h) => el("th", { text: h }))));
  conv.timeline.forEach((t, i) => {
    const total = t.read + t.write + t.uncached;
    table.append(el("tr", { "data-id": t.id },
      el("td", {}, el("a", { href: `#/x/${t.id}`, text: String(i + 1) })),
      el("td", { text: fmtTime(t.started_ms) }),
      el("td", { text: t.model }),
      el("td", {}, el("span", { class: `badge ${verdictClass(t.verdict)}`, text: t.verdict })),
      el("td", { class: "num", text: t.read }), el("td", { class: "num", text: t.write }), el("td", { class: "num", text: t.uncached }),
      el("td", { class: "num", text: total ? `${((100 * t.read) / total).toFixed(0)}%` : "" }),
      el("td", { class: "num", text: t.cost ? fmtUsd(t.cost.input_usd) : "unknown" }),
      el("td", { class: "num turn-total", text: t.cost ? fmtUsd(t.cost.total_usd ?? t.cost.input_usd) : "unknown" }),
      el("td", { class: "num", text: t.cost && t.cost.lost_usd ? fmtUsd(t.cost.lost_usd) : "" }),
      el("td", {}, t.reason_text || "", t.baseline && t.verdict !== "hit" ? [" ", el("a", { href: `#/d/${t.baseline}/${t.id}`, text: "diff" })] : "",
        t.fix ? el("div", { class: "fix", text: `fix: ${t.fix}` }) : null)));
  });
  const lost = el("table", { class: "turns", id: "lost" }, el("tr", {}, ["miss reason", "requests", "tokens", "lost $"].map((h) => el("th", { text: h }))));
  for (const l of s.lost) lost.append(el("tr", {}, el("td", { text: l.reason }), el("td", { class: "num", text: l.requests }), el("td", { class: "num", text: l.tokens }), el("td", { class: "num", text: s.priced ? fmtUsd(l.usd) : "unknown" })));
  page.replaceChildren(
    el("h2", {}, "conversation ", el("span", { class: "mono", text: conv.conversation })),
    el("div", {}, `${s.requests} requests · hit rate ${(100 * s.hit_rate).toFixed(1)}% · read ${s.read_tokens} · write ${s.write_tokens} · uncached ${s.uncached_tokens}` + (s.priced ? ` · saved ${fmtUsd(s.saved_usd)} · lost ${fmtUsd(s.lost_usd)}` : "") +
      (s.unpriced.length ? ` · cost unknown for ${s.unpriced.join(", ")} (no price configured)` : "")),
    chart, el("h3", { text: "Turns" }), table, el("h3", { text: "Lost per miss reason" }), s.lost.length ? lost : el("p", { class: "empty", text: "No miss lost anything." }));
  const anatomy = await api(`/api/anatomy?conversation=${encodeURIComponent(key)}`).catch(() => null);
  if (anatomy && anatomy.turns.length && currentView === "conversation") page.append(conversationAnatomy(anatomy));
}

// A conversation's anatomy: per turn, a bar of its prompt's families (by the
// provider's count), what each family added since the turn before, and each
// family's dollars over the conversation.
function conversationAnatomy(a) {
  const box = el("div", { class: "section", id: "conversation-anatomy" });
  const max = Math.max(1, ...a.turns.map((t) => t.families.reduce((n, f) => n + f.tokens, 0)));
  const width = 560, barH = 14, gap = 4;
  const plot = svg("svg", { width: String(width), height: String(a.turns.length * (barH + gap) + 4), role: "img", "aria-label": "tokens per family per turn" });
  a.turns.forEach((t, i) => {
    let x = 0;
    for (const f of t.families) {
      const w = (f.tokens / max) * width;
      const rect = svg("rect", { x: String(x), y: String(i * (barH + gap)), width: String(w), height: String(barH), class: `family-${f.family}` });
      const title = svg("title", {});
      title.textContent = `turn ${i + 1}: ${f.family} ${f.tokens}`;
      rect.append(title);
      plot.append(rect);
      x += w;
    }
  });
  const families = a.families.map((f) => f.family);
  const table = el("table", { class: "turns" }, el("tr", {}, ["turn", ...families].map((h) => el("th", { text: h }))));
  let before = null;
  a.turns.forEach((t, i) => {
    const cells = families.map((name) => {
      const now = (t.families.find((f) => f.family === name) || { tokens: 0 }).tokens;
      const was = before ? (before.find((f) => f.family === name) || { tokens: 0 }).tokens : null;
      const delta = was === null || was === now ? "" : ` (${now > was ? "+" : "−"}${fmtNum(Math.abs(now - was))})`;
      return el("td", { class: "num", text: `${fmtNum(now)}${delta}` });
    });
    table.append(el("tr", {}, el("td", {}, el("a", { href: `#/x/${t.id}`, text: String(i + 1) })), ...cells));
    before = t.families;
  });
  table.append(el("tr", {}, el("td", { text: "input $" }), ...a.families.map((f) => el("td", { class: "num", text: f.usd === undefined || f.usd === null ? "—" : fmtUsd(f.usd) }))));
  const legend = familyLegend(families);
  box.append(el("h3", { text: "Prompt anatomy per turn" }), legend, plot, table);
  // Which part's changes missed the cache, and what that lost.
  for (const m of a.misses || []) {
    box.append(el("div", { class: "mono miss-by-family" }, `${m.family} changed: ${m.misses} cache miss${m.misses === 1 ? "" : "es"}, ${fmtUsd(m.lost_usd)} lost (turn${m.turns.length === 1 ? "" : "s"} `,
      ...m.turns.flatMap((id, i) => [i ? ", " : "", el("a", { href: `#/x/${id}`, text: id.slice(-6) })]), ")"));
  }
  const advice = adviceList(a.advice);
  if (advice) box.append(el("h4", { text: "Advice" }), advice);
  return box;
}

// ---------------------------------------------------------------- rules

let rulesTimer = null;
async function showRules() {
  navActive("rules");
  const r = await api("/api/rules");
  if (currentView !== "rules") return;
  // Rules reload on their own: the view follows every 2 s while it is open.
  clearTimeout(rulesTimer);
  rulesTimer = setTimeout(() => currentView === "rules" && showRules().catch(showError), 2000);
  const page = el("div", { class: "page", id: "rules" });
  setMain(page);
  const last = r.last_reload;
  page.append(
    el("h2", { text: "Rules" }),
    el("div", { text: r.state }),
    el("div", { text: `reloads: ${r.reloads.ok} ok, ${r.reloads.failed} failed${last ? ` · last ${fmtTime(last.at_ms)} ${last.ok ? "ok" : "FAILED"}` : ""}` }),
    last && last.error ? el("pre", { class: "error", id: "reload-error", text: (last.errors || [last.error]).join("\n") }) : null);
  const byFile = new Map();
  for (const rule of r.rules) {
    if (!byFile.has(rule.file)) byFile.set(rule.file, []);
    byFile.get(rule.file).push(rule);
  }
  for (const [file, rules] of byFile) {
    const table = el("table", { class: "turns" }, el("tr", {}, ["rule", "phase", "when", "actions", "fired", "line"].map((h) => el("th", { class: ["fired", "line"].includes(h) ? "num" : "", text: h }))));
    for (const rule of rules) {
      table.append(el("tr", { class: rule.enabled ? "" : "empty" },
        el("td", {}, el("b", { text: rule.name }), rule.description ? el("div", { class: "empty", text: rule.description }) : null),
        el("td", { text: rule.phase }), el("td", { class: "mono", text: rule.when.join(", ") }), el("td", { class: "mono", text: rule.actions.join(", ") }),
        el("td", { class: "num", text: rule.fired ?? "—" }), el("td", { class: "num", text: rule.line })));
    }
    page.append(el("h3", { class: "mono", text: file }), table);
  }
  // Hooks, in load order: where each event goes, and what it decided so far.
  if ((r.hooks || []).length) {
    const table = el("table", { class: "turns", id: "hooks" }, el("tr", {}, ["hook", "phases", "transport", "timeout", "on error", "decisions", "where"].map((h) => el("th", { text: h }))));
    for (const h of r.hooks) {
      const decisions = h.decisions ? Object.entries(h.decisions).map(([k, v]) => `${k} ${v}`).join(" · ") : "—";
      table.append(el("tr", {},
        el("td", {}, el("b", { text: h.name }), h.enforce ? el("span", { class: "badge", text: "enforce" }) : null),
        el("td", { text: h.phases.join(", ") }), el("td", { class: "mono", text: h.transport }), el("td", { class: "num", text: `${h.timeout_ms} ms` }),
        el("td", { text: h.on_error }), el("td", { class: "mono", text: decisions || "none yet" }), el("td", { class: "mono", text: `${h.file}:${h.line}` })));
    }
    page.append(el("h3", { text: "Hooks" }), table);
  }
  // The outgoing-secrets scans: what each selects and does.
  if ((r.scans || []).length) {
    const table = el("table", { class: "turns", id: "scans" }, el("tr", {}, ["scan", "selects", "action"].map((h) => el("th", { text: h }))));
    for (const s of r.scans) table.append(el("tr", {}, el("td", {}, el("b", { text: s.name })), el("td", { class: "mono", text: s.selects }), el("td", { class: "mono", text: s.action })));
    page.append(el("h3", { text: "Scans" }), table);
  }
  if (!r.rules.length && !(r.hooks || []).length && !(r.scans || []).length) page.append(el("p", { class: "empty", text: `No rules are live. Put TOML rule files in ${r.dir}.` }));
}

// ---------------------------------------------------------------- routing

let currentView = null, currentId = null;

let budgetsTimer = null;
// Budgets: each one's scope, window and limits, and what each of its scopes spent
// (most first), with its share of the nearest limit and when it resets.
async function showBudgets() {
  navActive("budgets");
  const r = await api("/api/budgets");
  if (currentView !== "budgets") return;
  // Spend moves with every exchange: the view follows every 2 s while it is open.
  clearTimeout(budgetsTimer);
  budgetsTimer = setTimeout(() => currentView === "budgets" && showBudgets().catch(showError), 2000);
  const page = el("div", { class: "page", id: "budgets" }, el("h2", { text: "Budgets" }));
  setMain(page);
  for (const b of r.budgets) {
    const table = el("table", { class: "turns" }, el("tr", {}, ["scope", "spent", "requests", "input tokens", "output tokens", "of the limit", "resets"].map((h) => el("th", { text: h }))));
    for (const s of b.scopes) {
      table.append(el("tr", { class: s.share >= 1 ? "spent" : "" },
        el("td", { class: "mono", text: s.scope }), el("td", { class: "num", text: fmtUsd(s.usd) }), el("td", { class: "num", text: s.requests }),
        el("td", { class: "num", text: fmtNum(s.input_tokens) }), el("td", { class: "num", text: fmtNum(s.output_tokens) }),
        // A meter, not a styled bar: the viewer's policy allows no inline style.
        el("td", {}, el("meter", { min: "0", max: "1", low: "0.8", high: "0.99", optimum: "0", value: String(Math.min(1, s.share)) }), ` ${(100 * s.share).toFixed(0)} %`),
        el("td", { text: s.resets })));
    }
    if (!b.scopes.length) table.append(el("tr", {}, el("td", { class: "empty", colspan: "7", text: "nothing spent in this window yet" })));
    page.append(el("h3", {}, el("b", { text: b.name })), el("div", { text: `per ${b.scope} · ${b.window} · limit ${b.limits}` }), table);
  }
  if (!r.budgets.length) page.append(el("p", { class: "empty", text: "No budgets are live. Declare [[budget]] tables in the rules directory (see docs/budgets.md)." }));
}

function showError(e) {
  setMain(el("div", { class: "page" }, el("p", { class: "error", text: String(e.message || e) })));
}

function route() {
  if (!state.loaded) return;
  const hash = location.hash.replace(/^#/, "") || "/";
  const [path, query] = hash.split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  currentId = null;
  listEl = null;
  const run = (view, f) => {
    currentView = view;
    Promise.resolve(f()).catch(showError);
  };
  if (parts[0] === "x" && parts[1]) run("exchange", () => ((currentId = parts[1]), showExchange(parts[1])));
  else if (parts[0] === "d" && parts[2]) run("diff", () => showDiff(parts[1], parts[2]));
  else if (parts[0] === "c" && parts[1]) run("conversation", () => showConversation(parts.slice(1).join("/")));
  else if (parts[0] === "conversations") run("conversations", showConversations);
  else if (parts[0] === "rules") run("rules", showRules);
  else if (parts[0] === "budgets") run("budgets", showBudgets);
  else run("list", () => showList(new URLSearchParams(query || "")));
}

document.addEventListener("keydown", (e) => {
  const typing = ["INPUT", "SELECT", "TEXTAREA"].includes(document.activeElement?.tagName);
  if (e.key === "Escape") {
    if (typing) document.activeElement.blur();
    else if (currentView !== "list") history.back();
    return;
  }
  if (typing || e.ctrlKey || e.metaKey || e.altKey) return;
  if (e.key === "/") {
    if (currentView !== "list") location.hash = "#/";
    setTimeout(() => document.getElementById("search")?.focus(), 0);
    e.preventDefault();
  } else if (currentView === "list" && (e.key === "j" || e.key === "ArrowDown")) {
    moveSelection(1);
    e.preventDefault();
  } else if (currentView === "list" && (e.key === "k" || e.key === "ArrowUp")) {
    moveSelection(-1);
    e.preventDefault();
  } else if (currentView === "list" && e.key === "Enter" && state.visible[state.selected]) {
    location.hash = `#/x/${state.visible[state.selected]}`;
  }
});

window.addEventListener("hashchange", route);
loadRows()
  .then(connect)
  .catch((e) => {
    state.loaded = true;
    showError(e);
    connect();
  });
