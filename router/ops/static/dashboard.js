// kvroute dashboard: polls dashboard/data and draws it. Plain JS and inline SVG, no libraries.
"use strict";

const params = new URLSearchParams(location.search);
const POLL_MS = Math.max(500, Number(params.get("interval_ms")) || 2000);
const TIERS = ["GPU", "CPU", "STORAGE"];
const SVG = "http://www.w3.org/2000/svg";
const state = { data: null, page: 0, sort: "load", filter: "", pageSize: 20, lastOk: 0 };
// A router started with --api-key guards /dashboard/data: the key is asked for once and kept
// for this tab only (sessionStorage), never in the URL.
const KEY_STORE = "kvroute-api-key";
let pollTimer = 0;

const $ = (id) => document.getElementById(id);
const fmt = (n) => (n === null || n === undefined ? "–" : Number(n).toLocaleString("en-US"));
const pct = (x) => (x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%");
const ms = (s) => (s === null || s === undefined ? "–" : (1000 * s).toFixed(s < 0.01 ? 2 : 1) + " ms");
function age(s) {
  if (s === null || s === undefined) return "–";
  if (s < 60) return s.toFixed(1) + " s";
  if (s < 3600) return (s / 60).toFixed(1) + " min";
  return (s / 3600).toFixed(1) + " h";
}
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-") || k === "title") node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) node.append(c instanceof Node ? c : String(c));
  return node;
}
function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}
function setText(id, value) { const n = $(id); if (n) n.textContent = value; }

// ---------------------------------------------------------------- header and cards
function renderSummary(d) {
  const f = d.fleet;
  setText("router-id", `${location.host} (${d.router.host} pid ${d.router.pid})`);
  setText("policy", d.router.policy);
  setText("uptime", age(d.router.uptime_s));
  setText("replica-count", fmt(f.replicas));
  setText("healthy-count", fmt(f.healthy_replicas));
  const withFeed = d.replicas.filter((r) => r.freshness !== null).length;
  setText("feeds-live", `${fmt(f.freshness.live || 0)} / ${fmt(withFeed)}`);
  setText("feed-states", Object.entries(f.freshness).sort().map(([k, v]) => `${k} ${v}`).join(" · "));
  setText("in-flight", fmt(f.in_flight));
  setText("requests-total", fmt(f.requests));
  setText("entries-total", fmt(f.entries));
  for (const t of TIERS) setText("fleet-" + t, fmt(f.entries_by_tier[t]));
  setText("hit-predicted", pct(f.predicted_hit_rate));
  setText("hit-delivered", pct(f.delivered_hit_rate));
  renderPeers(d.peers || []);
  const reasons = $("reasons");
  reasons.replaceChildren("decisions by reason: ");
  for (const [k, v] of Object.entries(f.reasons).sort((a, b) => b[1] - a[1])) {
    reasons.append(`${k} `, el("b", {}, fmt(v)));
  }
}

function renderPeers(peers) {
  const node = $("peers");
  if (!peers.length) { node.textContent = "Peers: none (no --peer): open each router's /dashboard."; return; }
  node.replaceChildren("Sharing load with: ");
  peers.forEach((p, i) => {
    if (i) node.append(", ");
    node.append(el("span", { class: "peer " + (p.fresh ? "ok" : "stale"), "data-peer": p.url, title: p.error || (p.fresh ? "fresh" : "stale") }, p.router || p.url));
  });
}

// ---------------------------------------------------------------- prefill/decode
function renderPd(pd) {
  const panel = $("pd");
  panel.hidden = !pd;
  if (!pd) return;
  setText("pd-split", fmt(pd.split));
  setText("pd-bypassed", fmt(pd.bypassed));
  setText("pd-bypass-rate", pct(pd.bypass_rate));
  setText("pd-on-prefill", fmt(pd.on_prefill));
  setText("pd-on-prefill-fallbacks", fmt(pd.on_prefill_fallbacks));
  setText("pd-resumed-streams", fmt(pd.resumed_streams));
  setText("pd-resume-failures", fmt(pd.resume_failures));
  setText("pd-prefill-legs", fmt(pd.prefill_legs));
  setText("pd-decode-legs", fmt(pd.decode_legs));
  setText("pd-prefill-failures", fmt(pd.prefill_failures));
  setText("pd-prefill-fallbacks", fmt(pd.prefill_fallbacks));
  setText("pd-missing-params", fmt(pd.missing_transfer_params));
  setText("pd-transfer-failures", fmt(pd.transfer_failures));
  setText("pd-pull-failures", fmt(pd.pull_failures));
  setText("pd-expired-leases", fmt(pd.expired_leases));
  const body = $("pd-pools").tBodies[0];
  body.replaceChildren(...Object.entries(pd.pools || {}).sort().map(([role, p]) => {
    const tr = el("tr", { "data-pool": role });
    tr.append(td("role", role), td("replicas", fmt(p.replicas), "num"), td("healthy", fmt(p.healthy), "num"),
      td("in_flight", fmt(p.in_flight), "num"), td("pending", fmt(p.pending), "num"));
    return tr;
  }));
}

// ---------------------------------------------------------------- charts
function hitChart(points) {
  const root = $("hit-chart");
  const W = 640, H = 200, L = 34, R = 34, T = 8, B = 18;
  root.replaceChildren();
  const x = (i) => L + (points.length < 2 ? 0 : (i * (W - L - R)) / (points.length - 1));
  const y = (v) => T + (1 - v) * (H - T - B);
  for (const v of [0, 0.25, 0.5, 0.75, 1]) {
    root.append(svg("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), class: "grid" }));
    root.append(svg("text", { x: 2, y: y(v) + 3 }, `${v * 100}%`));
  }
  const rpsMax = Math.max(1, ...points.map((p) => p.requests_per_s || 0));
  root.append(svg("text", { x: W - R + 4, y: T + 8 }, rpsMax.toFixed(rpsMax < 10 ? 1 : 0)));
  root.append(svg("text", { x: W - R + 4, y: H - B }, "0/s"));
  if (points.length) {
    const span = points[points.length - 1].t - points[0].t;
    root.append(svg("text", { x: L, y: H - 4 }, `${age(span)} ago`));
    root.append(svg("text", { x: W - R - 20, y: H - 4 }, "now"));
  }
  const line = (key, cls, scale) => {
    let dpath = "", pen = false;
    points.forEach((p, i) => {
      const v = p[key];
      if (v === null || v === undefined) { pen = false; return; }
      dpath += `${pen ? "L" : "M"}${x(i).toFixed(1)},${y(scale(v)).toFixed(1)} `;
      pen = true;
    });
    const colors = { rps: "var(--rps)", pred: "var(--pred)", deliv: "var(--deliv)" };
    root.append(svg("path", { d: dpath, fill: "none", stroke: colors[cls], "stroke-width": cls === "rps" ? 1 : 2, "stroke-dasharray": cls === "pred" ? "6 4" : "none", "data-series": key }));
    if (cls === "rps") return;
    points.forEach((p, i) => {  // a dot per interval: an isolated interval shows too
      const v = p[key];
      if (v !== null && v !== undefined) root.append(svg("circle", { cx: x(i), cy: y(scale(v)), r: 2.5, fill: colors[cls] }));
    });
  };
  line("requests_per_s", "rps", (v) => v / rpsMax);
  line("delivered_hit_rate", "deliv", (v) => Math.min(1, v));
  line("predicted_hit_rate", "pred", (v) => Math.min(1, v));  // dashed, on top: equal lines stay visible
  if (!points.length) root.append(svg("text", { x: W / 2 - 60, y: H / 2 }, "collecting samples…"));
}

function requestsChart(replicas) {
  const root = $("requests-chart");
  const W = 320, H = 200, top = 10;
  root.replaceChildren();
  const rows = [...replicas].sort((a, b) => b.requests - a.requests || a.name.localeCompare(b.name)).slice(0, top);
  setText("requests-chart-note", replicas.length > top ? `top ${top} of ${replicas.length}` : "routed by this router");
  const max = Math.max(1, ...rows.map((r) => r.requests));
  const rowH = H / Math.max(rows.length, 4);
  rows.forEach((r, i) => {
    const yy = i * rowH;
    const w = ((W - 150) * r.requests) / max;
    root.append(svg("text", { x: 0, y: yy + rowH / 2 + 3 }, r.name.length > 16 ? r.name.slice(0, 15) + "…" : r.name));
    root.append(svg("rect", { x: 100, y: yy + rowH * 0.2, width: Math.max(w, 1), height: rowH * 0.6, fill: "var(--gpu)", "data-replica": r.name }));
    root.append(svg("text", { x: 104 + w, y: yy + rowH / 2 + 3 }, fmt(r.requests)));
  });
}

// ---------------------------------------------------------------- replica table
const SORTS = {
  load: (a, b) => b.pending - a.pending || b.kv_cache_usage - a.kv_cache_usage || a.name.localeCompare(b.name),
  name: (a, b) => a.name.localeCompare(b.name, "en", { numeric: true }),
  entries: (a, b) => b.entries - a.entries || a.name.localeCompare(b.name),
  requests: (a, b) => b.requests - a.requests || a.name.localeCompare(b.name),
  kv: (a, b) => b.kv_cache_usage - a.kv_cache_usage || a.name.localeCompare(b.name),
  problems: (a, b) => problem(b) - problem(a) || a.name.localeCompare(b.name),
};
function problem(r) { return (r.healthy ? 0 : 2) + (r.freshness && r.freshness !== "live" ? 1 : 0); }

function pill(text, cls) { return el("span", { class: "pill " + cls }, text); }
function td(field, content, cls) {
  const cell = el("td", { "data-field": field, class: cls || "" });
  cell.append(content instanceof Node ? content : String(content));
  return cell;
}

function renderReplicas(replicas) {
  const q = state.filter.trim().toLowerCase();
  const rows = replicas.filter((r) => !q || r.name.toLowerCase().includes(q) || (r.freshness || "no feed").includes(q) || (q === "down" && !r.healthy));
  rows.sort(SORTS[state.sort] || SORTS.load);
  const pages = Math.max(1, Math.ceil(rows.length / state.pageSize));
  state.page = Math.min(state.page, pages - 1);
  const start = state.page * state.pageSize;
  const shown = rows.slice(start, start + state.pageSize);
  setText("page-info", rows.length ? `${start + 1}-${start + shown.length} of ${rows.length} · page ${state.page + 1}/${pages}` : "no replica");
  $("prev").disabled = state.page === 0;
  $("next").disabled = state.page >= pages - 1;
  const maxEntries = Math.max(1, ...replicas.map((r) => r.entries_by_tier.GPU + r.entries_by_tier.CPU + r.entries_by_tier.STORAGE));
  const body = $("replicas").tBodies[0];
  body.replaceChildren(...shown.map((r) => {
    const tr = el("tr", { "data-replica": r.name });
    tr.append(td("name", el("span", { title: r.url || "" }, r.name)));
    tr.append(td("role", r.role));
    tr.append(td("health", r.healthy ? pill("ok", "ok") : pill("down", "down")));
    if (!r.healthy && r.last_error) tr.lastChild.title = r.last_error;
    const feed = r.freshness === null ? pill("no feed", "nofeed") : pill(r.freshness, r.freshness);
    tr.append(td("freshness", feed));
    if (r.freshness_reason) tr.lastChild.title = r.freshness_reason;
    tr.append(td("last_event_age_s", age(r.last_event_age_s), "num"));
    for (const t of TIERS) tr.append(td(t, fmt(r.entries_by_tier[t]), "num"));
    const bar = el("span", { class: "tierbar", title: TIERS.map((t) => `${t} ${r.entries_by_tier[t]}`).join(", ") });
    for (const t of TIERS) {
      const w = (100 * r.entries_by_tier[t]) / maxEntries;
      if (w > 0) {
        const part = el("span", { class: t });
        part.style.width = `${w}%`;
        bar.append(part);
      }
    }
    tr.append(td("tiers", bar));
    tr.append(td("pending", fmt(r.pending), "num"));
    tr.append(td("running", fmt(r.running), "num"));
    tr.append(td("waiting", fmt(r.waiting), "num"));
    const usage = el("span", { class: "usage" + (r.kv_cache_usage > 0.9 ? " hot" : ""), title: pct(r.kv_cache_usage) });
    const fill = el("span", {});
    fill.style.width = `${Math.min(100, 100 * r.kv_cache_usage)}%`;
    usage.append(fill);
    const kv = el("span", {}, usage, " ", pct(r.kv_cache_usage));
    tr.append(td("kv_cache_usage", kv));
    tr.append(td("prefill_s_per_1k", r.prefill_s_per_token === null || r.prefill_s_per_token === undefined ? "–" : (1000 * r.prefill_s_per_token).toPrecision(3), "num"));
    tr.lastChild.title = (r.rates_learned ? `learned from ${r.rates_samples} samples` : "the configured prior (not learned)") +
      `; load s/1k tok: CPU ${(1000 * (r.load_s_per_token_cpu || 0)).toPrecision(3)}, STORAGE ${(1000 * (r.load_s_per_token_storage || 0)).toPrecision(3)}`;
    tr.lastChild.dataset.samples = String(r.rates_samples);
    tr.append(td("queue_s_per_request", ms(r.queue_s_per_request), "num"));
    tr.append(td("requests", fmt(r.requests), "num"));
    tr.append(td("predicted_cached_tokens", fmt(r.predicted_cached_tokens), "num"));
    tr.append(td("delivered_cached_tokens", fmt(r.delivered_cached_tokens), "num"));
    return tr;
  }));
}

// ---------------------------------------------------------------- decisions
function renderDecisions(decisions) {
  const body = $("decisions").tBodies[0];
  body.replaceChildren(...decisions.map((d) => {
    const tr = el("tr", { "data-chosen": d.chosen, "data-reason": d.reason });
    tr.append(td("at", new Date(d.at * 1000).toLocaleTimeString()));
    tr.append(td("reason", el("span", { class: "reason", title: d.first_choice !== d.chosen ? `retried: first choice was ${d.first_choice}` : d.home ? `home: ${d.home}` : "" }, d.reason)));
    tr.append(td("chosen", d.chosen + (d.first_choice && d.first_choice !== d.chosen ? " (retry)" : "")));
    tr.append(td("prompt_tokens", fmt(d.prompt_tokens), "num"));
    tr.append(td("cached", `${fmt(d.predicted_cached_tokens)} → ${fmt(d.delivered_cached_tokens)}`, "num"));
    const cands = el("td", { class: "cands", "data-field": "candidates" });
    for (const c of d.candidates) {
      const tiers = Object.entries(c.tokens_by_tier).map(([t, n]) => `${t} ${n}`).join(", ");
      const chip = el("span", { class: "cand" + (c.name === d.chosen ? " chosen" : ""), "data-candidate": c.name, title: `pending ${c.pending}, feed ${c.freshness || "none"}${tiers ? "; " + tiers : ""}` },
        `${c.name} ${fmt(c.predicted_cached_tokens)} tok `, el("span", { class: "ttft" }, ms(c.est_ttft_s)));
      cands.append(chip);
    }
    if (d.more_candidates) cands.append(`+${d.more_candidates} more`);
    tr.append(cands);
    return tr;
  }));
  if (!decisions.length) body.append(el("tr", {}, el("td", { colSpan: 6 }, "no routed request yet")));
}

// ---------------------------------------------------------------- loop
function render() {
  const d = state.data;
  if (!d) return;
  renderSummary(d);
  hitChart(d.series);
  requestsChart(d.replicas);
  renderPd(d.disaggregation);
  renderReplicas(d.replicas);
  renderDecisions(d.decisions);
  document.body.dataset.takenAt = String(d.taken_at);
}

function authHeaders() {
  const key = sessionStorage.getItem(KEY_STORE);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function schedulePoll(delayMs) {
  clearTimeout(pollTimer);
  pollTimer = setTimeout(poll, delayMs);
}

async function poll() {
  try {
    const sent = sessionStorage.getItem(KEY_STORE);
    const resp = await fetch("dashboard/data", { cache: "no-store", headers: authHeaders() });
    if (resp.status === 401) {
      // A key typed while this request was in flight is the next poll's to try.
      if (sessionStorage.getItem(KEY_STORE) === sent) {
        sessionStorage.removeItem(KEY_STORE);
        $("key-form").hidden = false;
      }
      throw new Error("this router wants its API key");
    }
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    state.data = await resp.json();
    state.lastOk = Date.now();
    render();
    const s = $("status");
    s.dataset.state = "ok";
    s.textContent = `live · updated ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    const s = $("status");
    s.dataset.state = "error";
    s.textContent = `no data: ${err.message}` + (state.lastOk ? ` (last update ${new Date(state.lastOk).toLocaleTimeString()})` : "");
  } finally {
    schedulePoll(POLL_MS);
  }
}

$("sort").addEventListener("change", (e) => { state.sort = e.target.value; state.page = 0; render(); });
$("filter").addEventListener("input", (e) => { state.filter = e.target.value; state.page = 0; render(); });
$("page-size").addEventListener("change", (e) => { state.pageSize = Number(e.target.value); state.page = 0; render(); });
$("prev").addEventListener("click", () => { state.page = Math.max(0, state.page - 1); render(); });
$("next").addEventListener("click", () => { state.page += 1; render(); });
$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const key = $("api-key").value.trim();
  $("api-key").value = "";
  if (!key) return;
  sessionStorage.setItem(KEY_STORE, key);
  $("key-form").hidden = true;
  schedulePoll(0);
});
poll();
