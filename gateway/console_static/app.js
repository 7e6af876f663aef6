// The tokenbus operator's console: plain ES module, no dependencies, no build step.
// Every text a tenant chose (key names, owners) goes into the page as text, never as HTML.

const $ = (id) => document.getElementById(id);
const state = { me: null, csrf: "", page: "keys", keysOffset: 0, feed: null, feedPage: "", editing: null };
const PAGE = 50;

function el(tag, attrs = {}, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "on") for (const [ev, fn] of Object.entries(v)) e.addEventListener(ev, fn);
    else if (v !== undefined && v !== null && v !== false) e.setAttribute(k, v === true ? "" : v);
  }
  for (const k of kids) e.append(k instanceof Node ? k : document.createTextNode(k ?? ""));
  return e;
}

function say(text, error = false) {
  const s = $("status");
  s.textContent = text || "";
  s.className = error ? "error" : "";
}

async function api(method, path, body) {
  const opts = { method, headers: {}, credentials: "same-origin" };
  if (method !== "GET") opts.headers["X-CSRF-Token"] = state.csrf;
  if (body !== undefined) {
    opts.headers["Content-Type"] = "application/json";
    opts.body = JSON.stringify(body);
  }
  const r = await fetch("/console/api/" + path, opts);
  const data = r.headers.get("content-type")?.includes("json") ? await r.json() : await r.text();
  if (r.status === 401 && path !== "session") { showLogin("Your session ended: log in again."); }
  if (!r.ok) throw new Error(data?.error?.message || `HTTP ${r.status}`);
  return data;
}

// -- session ---------------------------------------------------------------------------
function showLogin(why) {
  stopFeed();
  state.me = null;
  $("nav").hidden = true;
  $("who").hidden = true;
  for (const p of document.querySelectorAll(".page")) p.hidden = true;
  $("login").hidden = false;
  say(why || "", Boolean(why));
  $("login-key").focus();
}

function loggedIn(me) {
  state.me = me;
  state.csrf = me.csrf_token;
  $("login").hidden = true;
  $("nav").hidden = false;
  $("who").hidden = false;
  $("who-name").textContent = `${me.name} (${me.key_id}, ${me.role})`;
  for (const a of document.querySelectorAll("nav a[data-admin]")) a.hidden = me.role !== "admin";
  $("key-form").hidden = me.role !== "admin";
  $("owner-budget-form").hidden = me.role !== "admin";
  say("");
  show(location.hash.slice(1) || "keys");
  startFeed();
}

$("login-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const input = $("login-key");
  const key = input.value.trim();
  input.value = ""; // the key is not kept anywhere in the page
  try {
    loggedIn(await api("POST", "session", { key }));
  } catch (e) {
    say("Log in failed: " + e.message, true);
  }
});

$("logout").addEventListener("click", async () => {
  try { await api("DELETE", "session"); } catch (e) { /* ended already */ }
  showLogin("Logged out.");
});

// -- pages -----------------------------------------------------------------------------
const loaders = { keys: loadKeysPage, spend: loadSpend, replicas: loadReplicas, jobs: loadJobsPage, audit: loadAudit, bus: loadBus };
const ADMIN_PAGES = ["replicas", "audit", "bus"];

function show(page) {
  if (!loaders[page]) page = "keys";
  if (state.me?.role !== "admin" && ADMIN_PAGES.includes(page)) page = "keys";
  state.page = page;
  for (const p of document.querySelectorAll(".page")) p.hidden = p.id !== "page-" + page;
  for (const a of document.querySelectorAll("nav a")) {
    if (a.dataset.page === page) a.setAttribute("aria-current", "page");
    else a.removeAttribute("aria-current");
  }
  if (state.feed && state.feedPage !== feedPage()) startFeed(); // the Bus page's feed is its own
  loaders[page]().catch((e) => say(e.message, true));
}

window.addEventListener("hashchange", () => { if (state.me) show(location.hash.slice(1)); });

// -- keys ------------------------------------------------------------------------------
function limits(k) {
  const out = [];
  if (k.rpm) out.push(`${k.rpm} rpm`);
  if (k.tpm) out.push(`${k.tpm} tpm`);
  if (k.max_concurrent) out.push(`${k.max_concurrent} at once`);
  if (k.models?.length) out.push("models: " + k.models.join(", "));
  if (k.admin) out.push("admin");
  return out.join(", ") || "none";
}

function budget(k) {
  if (k.budget_usd == null && k.soft_budget_usd == null) return "none";
  const parts = [];
  if (k.budget_usd != null) parts.push(`$${k.budget_usd}`);
  if (k.soft_budget_usd != null) parts.push(`soft $${k.soft_budget_usd}`);
  return parts.join(", ") + ` / ${k.budget_period}`;
}

async function loadKeys() {
  const q = encodeURIComponent($("keys-q").value.trim());
  const st = $("keys-state").value;
  const page = await api("GET", `keys?limit=${PAGE}&offset=${state.keysOffset}&q=${q}&state=${st}`);
  const rows = $("keys-rows");
  rows.replaceChildren();
  const admin = state.me.role === "admin";
  for (const k of page.data) {
    const actions = el("td");
    if (admin && k.enabled) {
      actions.append(
        el("button", { type: "button", "aria-label": `Edit key ${k.id}`, on: { click: () => editKey(k) } }, "Edit"), " ",
        el("button", { type: "button", "aria-label": `Rotate key ${k.id}`, on: { click: () => rotateKey(k) } }, "Rotate"), " ",
        el("button", { type: "button", class: "danger", "aria-label": `Revoke key ${k.id}`, on: { click: () => revokeKey(k) } }, "Revoke"),
      );
    }
    rows.append(el("tr", { "data-key": k.id },
      el("td", {}, el("code", {}, k.id)), el("td", {}, k.name), el("td", {}, k.owner || ""),
      el("td", {}, limits(k)), el("td", {}, budget(k)),
      el("td", { class: k.enabled ? "state-on" : "state-off" }, k.enabled ? "enabled" : "revoked"),
      actions));
  }
  const last = Math.min(page.total, state.keysOffset + page.data.length);
  $("keys-count").textContent = page.total ? `${state.keysOffset + 1}–${last} of ${page.total}` : "no keys";
  $("keys-prev").disabled = state.keysOffset === 0;
  $("keys-next").disabled = !page.has_more;
}

let searchTimer = null;
$("keys-q").addEventListener("input", () => {
  clearTimeout(searchTimer);
  searchTimer = setTimeout(() => { state.keysOffset = 0; loadKeys().catch((e) => say(e.message, true)); }, 200);
});
$("keys-state").addEventListener("change", () => { state.keysOffset = 0; loadKeys(); });
$("keys-prev").addEventListener("click", () => { state.keysOffset = Math.max(0, state.keysOffset - PAGE); loadKeys(); });
$("keys-next").addEventListener("click", () => { state.keysOffset += PAGE; loadKeys(); });

function showSecret(key) {
  $("secret-value").textContent = key;
  $("secret").hidden = false;
  $("secret-done").focus();
}
$("secret-done").addEventListener("click", () => { $("secret-value").textContent = ""; $("secret").hidden = true; });

function formFields(form, editing) {
  const out = {};
  for (const input of form.elements) {
    if (!input.name || input.name === "id") continue;
    if (input.type === "checkbox") { if (input.checked || editing) out[input.name] = input.checked; continue; }
    const v = input.value.trim();
    if (v === "") continue;
    if (input.name === "models") out.models = v.split(",").map((s) => s.trim()).filter(Boolean);
    else if (input.name === "aliases") out.aliases = aliasPairs(v);
    else if (input.type === "number") out[input.name] = Number(v);
    else out[input.name] = v;
  }
  return out;
}

// A key's own model aliases, as `tokenbus keys create --alias NAME=MODEL` takes them.
function aliasPairs(text) {
  const out = {};
  for (const pair of text.split(",").map((s) => s.trim()).filter(Boolean)) {
    const at = pair.indexOf("=");
    if (at < 1) throw new Error(`A model alias is NAME=MODEL, not "${pair}".`);
    out[pair.slice(0, at).trim()] = pair.slice(at + 1).trim();
  }
  return out;
}

function editKey(k) {
  const f = $("key-form");
  f.reset();
  state.editing = k.id;
  for (const input of f.elements) {
    if (!input.name) continue;
    const v = k[input.name];
    if (input.type === "checkbox") input.checked = Boolean(v);
    else if (input.name === "models") input.value = (v || []).join(", ");
    else if (input.name === "aliases") input.value = Object.entries(v || {}).map(([n, m]) => `${n}=${m}`).join(", ");
    else if (input.name !== "expires_in" && v != null) input.value = v;
  }
  $("key-form-title").textContent = `Edit key ${k.id}`;
  $("key-submit").textContent = "Save changes";
  $("key-cancel").hidden = false;
  f.querySelector("[name=name]").focus();
}

function endEdit() {
  state.editing = null;
  $("key-form").reset();
  $("key-form-title").textContent = "Create a key";
  $("key-submit").textContent = "Create key";
  $("key-cancel").hidden = true;
}
$("key-cancel").addEventListener("click", endEdit);

$("key-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  try {
    const fields = formFields(ev.target, Boolean(state.editing));
    if (state.editing) {
      const done = await api("PATCH", `keys/${state.editing}`, fields);
      say(`Key ${done.id} saved.`);
      endEdit();
    } else {
      const made = await api("POST", "keys", fields);
      say(`Key ${made.id} created.`);
      showSecret(made.key);
      ev.target.reset();
    }
    await loadKeys();
  } catch (e) { say(e.message, true); }
});

async function rotateKey(k) {
  const overlap = prompt(`Rotate key ${k.id}: seconds the current secret keeps working`, "3600");
  if (overlap === null) return;
  try {
    const done = await api("POST", `keys/${k.id}/rotate`, { overlap_s: Number(overlap) });
    say(`Key ${k.id} rotated.`);
    showSecret(done.key);
    await loadKeys();
  } catch (e) { say(e.message, true); }
}

async function revokeKey(k) {
  if (!confirm(`Revoke key ${k.id} (${k.name})? Requests with it are refused from now on.`)) return;
  try {
    await api("DELETE", `keys/${k.id}`);
    say(`Key ${k.id} revoked.`);
    await loadKeys();
  } catch (e) { say(e.message, true); }
}

// -- owner budgets (on the keys page) -----------------------------------------------------
function ownerBudgetNote(b) {
  const note = $("owner-budget-note");
  if (b.budget_usd == null && b.soft_budget_usd == null) { note.textContent = `Owner ${b.owner} has no budget.`; return; }
  const parts = [];
  if (b.budget_usd != null) parts.push(`$${b.budget_usd}`);
  if (b.soft_budget_usd != null) parts.push(`soft $${b.soft_budget_usd}`);
  note.textContent = `Owner ${b.owner}: ${parts.join(", ")} per ${b.period}; spent $${(b.spent_usd ?? 0).toFixed(4)} ${b.period === "total" ? "in all" : "this " + b.period}.`;
}

function ownerPath() {
  const owner = $("owner-budget-form").elements.owner.value.trim();
  if (!owner) throw new Error("Owner: the owner whose budget this is.");
  return `owners/${encodeURIComponent(owner)}/budget`;
}

$("owner-budget-show").addEventListener("click", async () => {
  try {
    const b = await api("GET", ownerPath());
    const f = $("owner-budget-form").elements;
    f.budget_usd.value = b.budget_usd ?? "";
    f.soft_budget_usd.value = b.soft_budget_usd ?? "";
    if (b.period) f.period.value = b.period;
    ownerBudgetNote(b);
  } catch (e) { say(e.message, true); }
});

$("owner-budget-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const f = ev.target.elements;
  const amount = (input) => (input.value.trim() === "" ? null : Number(input.value));
  try {
    const b = await api("PUT", ownerPath(), {
      budget_usd: amount(f.budget_usd), soft_budget_usd: amount(f.soft_budget_usd), period: f.period.value,
    });
    say(`The budget of owner ${b.owner} is saved.`);
    ownerBudgetNote(b);
    await loadOwnerBudgets();
  } catch (e) { say(e.message, true); }
});

// The owners that have a budget (admin sessions), each with Edit (fills the form above) and
// Remove (both amounts emptied, as the form removes one).
async function loadKeysPage() {
  await loadKeys();
  if (state.me?.role === "admin") await loadOwnerBudgets();
}

async function loadOwnerBudgets() {
  const list = await api("GET", "owners");
  const rows = $("owner-budget-rows");
  rows.replaceChildren();
  for (const b of list.data) {
    const spent = `$${(b.spent_usd ?? 0).toFixed(4)}${b.held_usd ? ` (+$${b.held_usd.toFixed(4)} held)` : ""}`;
    rows.append(el("tr", { "data-owner": b.owner },
      el("td", {}, b.owner), el("td", {}, budget({ ...b, budget_period: b.period })), el("td", {}, spent),
      el("td", {},
        el("button", { type: "button", class: "edit", "aria-label": `Edit the budget of owner ${b.owner}`,
          on: { click: () => editOwnerBudget(b) } }, "Edit"), " ",
        el("button", { type: "button", class: "danger", "aria-label": `Remove the budget of owner ${b.owner}`,
          on: { click: () => removeOwnerBudget(b) } }, "Remove"))));
  }
  if (!list.data.length) rows.append(el("tr", {}, el("td", { colspan: "4" }, "No owner has a budget.")));
}

function editOwnerBudget(b) {
  const f = $("owner-budget-form").elements;
  f.owner.value = b.owner;
  f.budget_usd.value = b.budget_usd ?? "";
  f.soft_budget_usd.value = b.soft_budget_usd ?? "";
  f.period.value = b.period;
  ownerBudgetNote(b);
  f.budget_usd.focus();
}

async function removeOwnerBudget(b) {
  if (!confirm(`Remove the budget of owner ${b.owner}? Its keys are then held to their own budgets only.`)) return;
  try {
    await api("PUT", `owners/${encodeURIComponent(b.owner)}/budget`, { budget_usd: null, soft_budget_usd: null, period: b.period });
    say(`The budget of owner ${b.owner} is removed.`);
    await loadOwnerBudgets();
  } catch (e) { say(e.message, true); }
}

// -- spend -----------------------------------------------------------------------------
// The bridge sums the period (gateway/console_spend.py): the page gets a page of the table,
// the chart's top keys and one "others" series, and the totals, never a row per key and day.
const COLORS = ["#0b57d0", "#c5221f", "#188038", "#e37400", "#8430ce", "#007b83", "#b80672", "#5f6368"];
const OTHERS = "(others)", OTHERS_COLOR = "#bdc1c6";
state.spendOffset = 0;

function measure(row, m) { return m === "tokens" ? row.prompt_tokens + row.completion_tokens : row[m]; }

function chart(c, m, bucketS, since, floor = 0) {
  const box = $("spend-chart");
  box.replaceChildren();
  if (!c.series.length) { box.append(el("p", { class: "note" }, "No usage in this period.")); return; }
  const keys = c.others ? [...c.keys, OTHERS] : [...c.keys];
  const color = (j) => keys[j] === OTHERS ? OTHERS_COLOR : COLORS[j % COLORS.length];
  // One slot per bucket from the start of the period to now: time reads left to right.
  const first = Math.floor(since / bucketS) * bucketS;
  const times = [];
  for (let t = first; t <= Date.now() / 1000; t += bucketS) times.push(t);
  const by = new Map();
  for (const r of c.series) by.set(`${r.t}|${r.key_id}`, (by.get(`${r.t}|${r.key_id}`) || 0) + measure(r, m));
  const totals = times.map((t) => keys.reduce((s, k) => s + (by.get(`${t}|${k}`) || 0), 0));
  const max = Math.max(...totals, floor, 1e-9); // floor: one key's budget, on this scale
  const W = 900, H = 240, L = 60, B = 24, T = 10;
  const ns = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(ns, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H + 20}`);
  const add = (tag, attrs, text) => {
    const e = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    svg.append(e);
    return e;
  };
  const bw = Math.max(1, (W - L - 10) / Math.max(times.length, 1) - 1);
  times.forEach((t, i) => {
    let y = H - B;
    keys.forEach((k, j) => {
      const v = by.get(`${t}|${k}`) || 0;
      const h = (v / max) * (H - B - T);
      y -= h;
      if (!v) return;
      const r = add("rect", { x: L + i * (bw + 1), y, width: bw, height: h, fill: color(j), "data-series": k });
      const when = new Date(t * 1000).toISOString().slice(0, bucketS >= 86400 ? 10 : 16).replace("T", " ");
      const title = document.createElementNS(ns, "title");
      title.textContent = `${when} ${k === OTHERS ? "others" : (c.labels?.[j] ?? k)}: ${v}`;
      r.append(title);
    });
  });
  add("line", { x1: L, y1: H - B, x2: W - 5, y2: H - B, stroke: "#8a93a3" });
  add("text", { x: 4, y: T + 10 }, fmt(max, m));
  add("text", { x: 4, y: H - B }, "0");
  if (times.length) {
    add("text", { x: L, y: H - 6 }, new Date(times[0] * 1000).toISOString().slice(0, 16).replace("T", " "));
    add("text", { x: W - 130, y: H - 6 }, new Date(times[times.length - 1] * 1000).toISOString().slice(0, 16).replace("T", " "));
  }
  keys.forEach((k, j) => {
    add("rect", { x: L + j * 92, y: H + 8, width: 10, height: 10, fill: color(j) });
    add("text", { x: L + j * 92 + 14, y: H + 17, "data-legend": k }, k === OTHERS ? `${c.others} others` : (c.labels?.[j] ?? k));
  });
  box.append(svg);
}

function fmt(v, m) { return m === "cost_usd" ? `$${v.toFixed(4)}` : String(Math.round(v)); }

// The owner view's chart in the key view's shape: an owner's series named "o:<owner>" (no
// owner's name can be OTHERS then), the rest (owner null) as OTHERS, legends the names.
const ownerName = (o) => o || "(no owner)";
function ownerChart(c) {
  const id = (o) => o === null ? OTHERS : "o:" + o;
  return { ...c, keys: c.owners.map(id), labels: c.owners.map(ownerName), series: c.series.map((r) => ({ ...r, key_id: id(r.owner) })) };
}

const SPEND_HEADS = {
  key: ["Usage per key and model, the costliest first", ["Key", "Model"]],
  owner: ["Usage per owner (every key of it), the costliest first", ["Owner", "Keys"]],
};

async function loadSpend() {
  const since = $("spend-since").value, bucket = $("spend-bucket").value, m = $("spend-measure").value;
  const group = $("spend-group").value;
  for (const id of ["spend-key", "spend-owner"]) {
    const shown = (id === "spend-owner") === (group === "owner");
    $(id).hidden = !shown;
    document.querySelector(`label[for='${id}']`).hidden = !shown;
  }
  const only = group === "key" ? $("spend-key").value.trim() : "";
  const owner = group === "owner" ? $("spend-owner").value.trim() : "";
  $("spend-csv").href = `/console/api/usage/export?since=${since}&bucket=${bucket}`;
  const q = new URLSearchParams({ since, bucket, measure: m, offset: state.spendOffset, limit: PAGE, group });
  if (only) q.set("key", only);
  if (owner) q.set("owner", owner);
  const u = await api("GET", "usage?" + q);
  let k = null, label = "";
  if (only && m === "cost_usd") {
    try { k = await api("GET", `keys/${encodeURIComponent(only)}`); } catch (e) { k = null; }
    label = `Key ${only}`;
  } else if (owner && m === "cost_usd") {
    k = u.budget ? { ...u.budget, budget_period: u.budget.period } : { budget_usd: null, soft_budget_usd: null };
    label = `Owner ${owner}`;
  }
  const top = k ? Math.max(u.totals.cost_usd, k.budget_usd ?? 0, k.soft_budget_usd ?? 0) : 0;
  chart(group === "owner" ? ownerChart(u.chart) : u.chart, m, u.bucket_s, u.since, top);
  budgetLines(label, k, u, top);
  const [caption, cols] = SPEND_HEADS[group];
  $("spend-caption").textContent = caption;
  $("spend-head").querySelectorAll("th").forEach((th, i) => { if (i < 2) th.textContent = cols[i]; });
  const rows = $("spend-rows");
  rows.replaceChildren();
  for (const s of u.data) {
    const first = group === "owner"
      ? [el("td", {}, ownerName(s.owner)), el("td", {}, String(s.keys))]
      : [el("td", {}, el("code", {}, s.key_id)), el("td", {}, s.model)];
    rows.append(el("tr", group === "owner" ? { "data-owner": s.owner } : { "data-key": s.key_id },
      ...first, el("td", {}, String(s.requests)),
      el("td", {}, String(s.prompt_tokens)), el("td", {}, String(s.completion_tokens)),
      el("td", {}, s.cost_usd.toFixed(6))));
  }
  const t = u.totals;
  $("spend-totals").textContent = `${t.requests} request${t.requests === 1 ? "" : "s"}, ${t.prompt_tokens + t.completion_tokens} tokens, $${t.cost_usd.toFixed(4)}`;
  const last = u.offset + u.data.length;
  $("spend-count").textContent = u.total ? `${u.offset + 1}–${last} of ${u.total}` : "no rows";
  $("spend-prev").disabled = u.offset === 0;
  $("spend-next").disabled = !u.has_more;
  if (u.truncated) say("Only the newest records were read: narrow the period for all of them.");
}
// One key's budget, or one owner's: its spend so far in the chart's period against the soft
// and hard thresholds, as lines over a cumulative total (the budget's own period may be
// longer), all on the chart's one scale (``top``). ``label``: "Key <id>" or "Owner <name>".
function budgetLines(label, k, u, top) {
  const note = $("spend-budget");
  note.textContent = "";
  if (!label || !k) return;
  if (k.budget_usd == null && k.soft_budget_usd == null) {
    note.textContent = `${label} has no budget.`;
    return;
  }
  const total = u.totals.cost_usd;
  const svg = $("spend-chart").querySelector("svg");
  const ns = "http://www.w3.org/2000/svg";
  const parts = [`${label}: $${total.toFixed(4)} in this view`];
  const H = 240, B = 24, T = 10, L = 60, W = 900;
  for (const [name, v, color] of [["hard", k.budget_usd, "#a4161a"], ["soft", k.soft_budget_usd, "#e37400"]]) {
    if (v == null) continue;
    parts.push(`${name} budget $${v} per ${k.budget_period}`);
    if (!svg) continue;
    const y = H - B - (v / top) * (H - B - T);
    const line = document.createElementNS(ns, "line");
    for (const [a, b] of Object.entries({ x1: L, x2: W - 5, y1: y, y2: y, stroke: color, "stroke-dasharray": "6 4", "data-budget": name })) line.setAttribute(a, b);
    const label = document.createElementNS(ns, "text");
    for (const [a, b] of Object.entries({ x: W - 120, y: y - 3 })) label.setAttribute(a, b);
    label.textContent = `${name} $${v}`;
    svg.append(line, label);
  }
  note.textContent = parts.join("; ") + ". The black line is the running total.";
  if (svg) {
    // The running total, on the same scale as the budget lines.
    let run = 0;
    const pts = [];
    const byT = new Map();
    for (const r of u.chart.series) byT.set(r.t, (byT.get(r.t) || 0) + r.cost_usd);
    const first = Math.floor(u.since / u.bucket_s) * u.bucket_s;
    const n = Math.max(1, Math.ceil((Date.now() / 1000 - first) / u.bucket_s));
    for (let i = 0; i < n; i++) {
      run += byT.get(first + i * u.bucket_s) || 0;
      pts.push(`${L + ((i + 1) / n) * (W - L - 10)},${H - B - (run / top) * (H - B - T)}`);
    }
    const poly = document.createElementNS(ns, "polyline");
    for (const [a, b] of Object.entries({ points: `${L},${H - B} ` + pts.join(" "), fill: "none", stroke: "#1b1f24", "stroke-width": 2, "data-running": "1" })) poly.setAttribute(a, b);
    svg.append(poly);
  }
}

const reloadSpend = (first) => () => { if (first) state.spendOffset = 0; loadSpend().catch((e) => say(e.message, true)); };
for (const id of ["spend-since", "spend-bucket", "spend-measure", "spend-group", "spend-key", "spend-owner"]) $(id).addEventListener("change", reloadSpend(true));
$("spend-refresh").addEventListener("click", reloadSpend(false));
$("spend-prev").addEventListener("click", () => { state.spendOffset = Math.max(0, state.spendOffset - PAGE); reloadSpend(false)(); });
$("spend-next").addEventListener("click", () => { state.spendOffset += PAGE; reloadSpend(false)(); });

// -- replicas --------------------------------------------------------------------------
function renderReplicas(list) {
  const rows = $("replicas-rows");
  rows.replaceChildren();
  for (const r of list) {
    rows.append(el("tr", { "data-replica": r.replica },
      el("td", {}, el("code", {}, r.replica)),
      el("td", { class: "host" }, r.host || "—"),
      el("td", { class: "site" }, siteOf(r)),
      el("td", {}, r.model), el("td", {}, r.backend || ""),
      el("td", {}, r.pd_role || "both"), el("td", {}, `${Math.round(r.load * 100)}% (${r.in_flight}/${r.max_concurrency})`),
      el("td", {}, String(r.running)), el("td", {}, String(r.waiting)), el("td", {}, r.kv_routing),
      el("td", { class: "kv-check" }, kvCheck(r.kv_check)),
      el("td", { class: "adapters" }, r.adapters && r.adapters.length ? r.adapters.join(", ") : "—"),
      el("td", { class: r.health === "ok" ? "state-on" : "state-off" }, r.health)));
  }
  if (!list.length) rows.append(el("tr", {}, el("td", { colspan: "13" }, "No live replica.")));
}

// A replica's site, with its accepts' round trip where this bridge's router measured it.
function siteOf(r) {
  if (!r.site) return "—";
  return r.ack_ms == null ? r.site : `${r.site} (${r.ack_ms} ms)`;
}

// What this bridge's router did with its site's requests: kept there, or spilled (by site).
function renderPlacements(p) {
  const line = $("replicas-placements");
  const spilled = Object.entries((p && p.spilled) || {});
  if (!p || !p.site || (!p.kept && !spilled.length)) { line.hidden = true; return; }
  const where = spilled.map(([site, n]) => `${site} ${n}`).join(", ");
  line.textContent = `This bridge's router, at site ${p.site}: ${p.kept} requests kept at its ` +
    `site, ${spilled.reduce((a, [, n]) => a + n, 0)} spilled${where ? ` (${where})` : ""}.`;
  line.hidden = false;
}

// The KV check's cached prompt tokens, predicted by the routers / reported by the engine.
function kvCheck(k) {
  if (!k) return "—";
  const ratio = k.ratio === null ? "" : ` (${Math.round(k.ratio * 100)}%)`;
  const verdict = k.verdict ? `, ${k.verdict}` : "";
  return `${k.predicted} / ${k.reported}${ratio}${verdict}`;
}

async function loadReplicas() {
  const out = await api("GET", "replicas");
  renderReplicas(out.data);
  renderPlacements(out.placements);
  await loadRouting();
  await loadAdapters();
}

// -- routing and aliases (on the replicas page): the routing admin API's changes ---------
async function loadRouting() {
  const routing = await api("GET", "routing");
  const aliases = await api("GET", "routing/aliases");
  $("routing").textContent = JSON.stringify({ ...routing, aliases: aliases.aliases }, null, 2);
  const d = routing.default;
  $("routing-default").textContent = `Every other model: policy ${d.policy}, pool policy ${d.pool_policy} (the configuration).`;
  const rows = $("routing-rows");
  rows.replaceChildren();
  for (const m of routing.models) {
    rows.append(el("tr", { "data-model": m.model },
      el("td", {}, el("code", {}, m.model)), el("td", {}, m.routing.policy), el("td", {}, m.routing.pool_policy),
      el("td", {}, el("code", {}, JSON.stringify(m.override))),
      el("td", {}, el("button", { type: "button", class: "edit", "aria-label": `Edit the routing of ${m.model}`,
        on: { click: () => editRouting(m) } }, "Edit"), " ",
      el("button", { type: "button", class: "danger", "aria-label": `Reset the routing of ${m.model}`,
        on: { click: () => resetRouting(m.model) } }, "Reset"))));
  }
  if (!routing.models.length) rows.append(el("tr", {}, el("td", { colspan: "5" }, "No model's routing is changed at run time.")));
  const arows = $("alias-rows");
  arows.replaceChildren();
  for (const a of aliases.aliases) {
    const act = el("td");
    if (a.source === "runtime") {
      act.append(el("button", { type: "button", class: "danger", "aria-label": `Delete the alias ${a.name}`,
        on: { click: () => deleteAlias(a.name) } }, "Delete"));
    }
    arows.append(el("tr", { "data-alias": a.name },
      el("td", {}, el("code", {}, a.name)), el("td", {}, a.model), el("td", {}, a.source), act));
  }
  if (!aliases.aliases.length) arows.append(el("tr", {}, el("td", { colspan: "4" }, "No alias.")));
}

async function resetRouting(model) {
  if (!model) { say("Model: the model whose routing to reset.", true); return; }
  try {
    await api("DELETE", `routing/${encodeURIComponent(model)}`);
    say(`The routing of ${model} is the default again.`);
    await loadRouting();
  } catch (e) { say(e.message, true); }
}

$("routing-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const f = ev.target;
  const model = f.elements.model.value.trim();
  try {
    if (!model) { f.elements.model.focus(); throw new Error("model: the model whose routing to change."); }
    const change = routingChange(f);
    const done = await api("PUT", `routing/${encodeURIComponent(model)}`, change);
    say(`The routing of ${done.model} is now policy ${done.routing.policy}, pool policy ${done.routing.pool_policy}; its change: ${JSON.stringify(done.override)}.`);
    await loadRouting();
  } catch (e) { say(e.message, true); }
});

// The form's fields as a change of the routing admin API, as `tokenbus router set` makes
// one: only the fields filled in; "tiered.threshold" is {"tiered": {"threshold": ...}}; a
// JSON field must hold an object of the shape its key names (the admin API checks the rest).
const JSON_SHAPES = {
  targets: [(v) => typeof v === "string" && v !== "",
    'a JSON object of cluster (its index or label) to "pool:<tag>" or a model, e.g. {"0": "pool:wide", "code": "coder"}'],
  latency: [(v) => v !== null && typeof v === "object" && !Array.isArray(v),
    'a JSON object of class (service tier) to {"ttft_ms": ..., "tpot_ms": ...}, e.g. {"priority": {"ttft_ms": 500, "tpot_ms": 50}}'],
};

function routingChange(form) {
  const change = {};
  for (const input of form.elements) {
    if (!input.name || input.name === "model") continue;
    const text = input.value.trim();
    if (text === "") continue;
    let value = text;
    if (input.type === "number") value = Number(text);
    else if (input.dataset.json) value = jsonField(input, text);
    const path = input.name.split(".");
    let at = change;
    for (const p of path.slice(0, -1)) at = at[p] ??= {};
    at[path[path.length - 1]] = value;
  }
  return change;
}

function jsonField(input, text) {
  const [fits, shape] = JSON_SHAPES[input.dataset.json];
  let v;
  try { v = JSON.parse(text); } catch (e) { v = undefined; }
  if (v === null || typeof v !== "object" || Array.isArray(v) || !Object.values(v).every(fits)) {
    input.focus();
    throw new Error(`${input.name}: ${shape}.`);
  }
  return v;
}

// Fill the form with a model's run-time change (what Set routing would send again).
function editRouting(m) {
  const f = $("routing-form");
  f.reset();
  f.elements.model.value = m.model;
  const shown = new Set();
  for (const input of f.elements) {
    if (!input.name || input.name === "model") continue;
    const path = input.name.split(".");
    shown.add(path[0]);
    const v = path.reduce((o, k) => (o == null ? undefined : o[k]), m.override);
    if (v !== undefined && v !== null) input.value = input.dataset.json ? JSON.stringify(v) : String(v);
  }
  const hidden = Object.keys(m.override || {}).filter((k) => !shown.has(k));
  say(hidden.length
    ? `The change of ${m.model} also sets ${hidden.join(", ")}, which this form does not show: Set routing would drop it (the admin API's JSON keeps it).`
    : `Editing the routing of ${m.model}.`, hidden.length > 0);
  f.elements.model.focus();
}
$("routing-reset").addEventListener("click", () => resetRouting($("routing-form").elements.model.value.trim()));

$("alias-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const f = ev.target;
  const name = f.elements.name.value.trim();
  try {
    const done = await api("PUT", `routing/aliases/${encodeURIComponent(name)}`, { model: f.elements.model.value.trim() });
    say(`Clients asking for ${done.name} are served ${done.model}.`);
    f.reset();
    await loadRouting();
  } catch (e) { say(e.message, true); }
});

async function deleteAlias(name) {
  if (!confirm(`Delete the alias ${name}? Clients asking for it are refused from now on.`)) return;
  try {
    await api("DELETE", `routing/aliases/${encodeURIComponent(name)}`);
    say(`The alias ${name} is deleted.`);
    await loadRouting();
  } catch (e) { say(e.message, true); }
}

// -- LoRA adapters (on the replicas page): the adapters admin API's loads and unloads -----
async function loadAdapters() {
  const list = await api("GET", "adapters");
  const rows = $("adapter-rows");
  rows.replaceChildren();
  for (const a of list.adapters) {
    rows.append(el("tr", { "data-adapter": a.name },
      el("td", {}, el("code", {}, a.name)), el("td", {}, a.model), el("td", {}, el("code", {}, a.path)),
      el("td", {}, a.wanted ? String(a.replicas) : "not wanted (loaded before an unload)"),
      el("td", { class: "loaded-on" }, a.loaded_on.length ? a.loaded_on.join(", ") : "no replica"),
      el("td", {}, el("button", { type: "button", class: "danger", "aria-label": `Unload the adapter ${a.name}`,
        on: { click: () => unloadAdapter(a.name) } }, "Unload"))));
  }
  if (!list.adapters.length) rows.append(el("tr", {}, el("td", { colspan: "6" }, "No adapter loaded at run time.")));
}

// A replica that failed is named in the answer; the others did it.
function failures(out) {
  return (out.failed || []).map((x) => `${x.replica}: ${x.error?.message || "failed"}`).join("; ");
}

$("adapter-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const f = ev.target.elements;
  const body = { name: f.name.value.trim(), model: f.model.value.trim(), path: f.path.value.trim() };
  if (f.replicas.value.trim() !== "") body.replicas = Number(f.replicas.value);
  say(`Loading the adapter ${body.name}…`);
  try {
    const out = await api("POST", "adapters", body);
    const on = out.loaded.map((x) => x.replica).join(", ");
    const bad = failures(out);
    say(`The adapter ${out.adapter.name} is loaded on ${on}.${bad ? " Failed on " + bad : ""}`, Boolean(bad));
    await loadAdapters();
  } catch (e) { say(e.message, true); }
});

async function unloadAdapter(name) {
  const drain = $("adapter-drain").value.trim() || "30";
  if (!confirm(`Unload the adapter ${name} everywhere, after at most ${drain} s of its running requests? Requests for it are refused from then on.`)) return;
  say(`Unloading the adapter ${name}…`);
  try {
    const out = await api("DELETE", `adapters/${encodeURIComponent(name)}?drain_s=${encodeURIComponent(drain)}`);
    const bad = failures(out);
    say(`The adapter ${name} is unloaded${out.unloaded.length ? " from " + out.unloaded.map((x) => x.replica).join(", ") : ""}.${bad ? " Failed on " + bad : ""}`, Boolean(bad));
    await loadAdapters();
  } catch (e) { say(e.message, true); }
}

// -- jobs ------------------------------------------------------------------------------
async function loadJobs() {
  const rows = $("jobs-rows");
  let list;
  try { list = await api("GET", "jobs"); } catch (e) {
    rows.replaceChildren(el("tr", {}, el("td", { colspan: "7" }, e.message)));
    return;
  }
  rows.replaceChildren();
  for (const b of list.data) {
    const c = b.request_counts || {};
    const act = el("td");
    if (state.me.role === "admin" && (b.status === "validating" || b.status === "in_progress")) {
      act.append(el("button", { type: "button", class: "danger", on: { click: async () => {
        try { await api("POST", `jobs/${encodeURIComponent(b.id)}/cancel`); await loadJobs(); } catch (e) { say(e.message, true); }
      } } }, "Cancel"));
    }
    const files = el("td", { class: "files" });
    for (const [label, id] of [["in", b.input_file_id], ["out", b.output_file_id], ["err", b.error_file_id]]) {
      if (id) files.append(el("div", {}, `${label} `, el("a", { href: `/console/api/files/${encodeURIComponent(id)}/content`, download: "" }, el("code", {}, id))));
    }
    rows.append(el("tr", { "data-batch": b.id }, el("td", {}, el("code", {}, b.id)), el("td", {}, b.owner || ""),
      el("td", {}, b.status), el("td", {}, `${(c.completed || 0) + (c.failed || 0)} / ${c.total || 0}`),
      files,
      el("td", {}, b.created_at ? new Date(b.created_at * 1000).toISOString().slice(0, 19).replace("T", " ") : ""), act));
  }
  if (!list.data.length) rows.append(el("tr", {}, el("td", { colspan: "7" }, "No batches.")));
}

// One background response by id: its status, and Cancel for an admin.
async function lookUpResponse(ev) {
  ev.preventDefault();
  const out = $("response-found");
  const id = $("response-id").value.trim();
  const path = `responses/${encodeURIComponent(id)}`;
  let r;
  try { r = await api("GET", path); } catch (e) { out.replaceChildren(e.message); return; }
  out.replaceChildren(el("code", {}, r.id), ` of ${r.owner || "nobody"}: `, el("span", { class: "status" }, r.status));
  if (state.me.role === "admin" && (r.status === "queued" || r.status === "in_progress")) {
    out.append(" ", el("button", { type: "button", class: "danger", on: { click: async () => {
      try { await api("POST", `${path}/cancel`); await lookUpResponse(ev); } catch (e) { say(e.message, true); }
    } } }, "Cancel"));
  }
}
$("response-form").addEventListener("submit", lookUpResponse);

// -- background responses (on the jobs page): listed newest first, paged by cursor --------
// state.responsesAfter: the cursors of the pages before this one ("" for the first).
state.responsesAfter = [""];

async function loadJobsPage() {
  state.responsesAfter = [""];
  await Promise.all([loadJobs(), loadResponses()]);
}

function responseProgress(r) {
  if (r.status === "queued") return "waiting to run";
  if (r.status === "in_progress") return r.events == null ? "running" : `${r.events} events so far`;
  const parts = [];
  if (r.output_tokens != null) parts.push(`${r.output_tokens} tokens out`);
  if (r.error) parts.push(`error ${r.error}`);
  return parts.join(", ");
}

async function loadResponses() {
  const rows = $("responses-rows");
  const after = state.responsesAfter[state.responsesAfter.length - 1];
  const q = new URLSearchParams({ limit: PAGE });
  if (after) q.set("after", after);
  let list;
  try { list = await api("GET", "responses?" + q); } catch (e) {
    rows.replaceChildren(el("tr", {}, el("td", { colspan: "7" }, e.message)));
    return;
  }
  rows.replaceChildren();
  for (const r of list.data) {
    const act = el("td");
    if (state.me.role === "admin" && (r.status === "queued" || r.status === "in_progress")) {
      act.append(el("button", { type: "button", class: "danger", "aria-label": `Cancel the background response ${r.id}`, on: { click: async () => {
        try {
          await api("POST", `responses/${encodeURIComponent(r.id)}/cancel`);
          say(`Background response ${r.id} cancelled.`);
          await loadResponses();
        } catch (e) { say(e.message, true); }
      } } }, "Cancel"));
    }
    rows.append(el("tr", { "data-response": r.id }, el("td", {}, el("code", {}, r.id)), el("td", {}, r.owner || ""),
      el("td", { class: "status" }, r.status), el("td", { class: "progress" }, responseProgress(r)), el("td", {}, r.model || ""),
      el("td", {}, r.created_at ? new Date(r.created_at * 1000).toISOString().slice(0, 19).replace("T", " ") : ""), act));
  }
  if (!list.data.length) rows.append(el("tr", {}, el("td", { colspan: "7" }, "No background responses.")));
  const first = (state.responsesAfter.length - 1) * PAGE;
  $("responses-count").textContent = list.total ? `${first + 1}–${first + list.data.length} of ${list.total}` : "";
  $("responses-prev").disabled = state.responsesAfter.length === 1;
  $("responses-next").disabled = !list.has_more;
  $("responses-next").dataset.after = list.last_id || "";
}

$("responses-prev").addEventListener("click", () => {
  if (state.responsesAfter.length > 1) state.responsesAfter.pop();
  loadResponses().catch((e) => say(e.message, true));
});
$("responses-next").addEventListener("click", () => {
  state.responsesAfter.push($("responses-next").dataset.after);
  loadResponses().catch((e) => say(e.message, true));
});
$("responses-refresh").addEventListener("click", () => loadResponses().catch((e) => say(e.message, true)));

// -- audit -----------------------------------------------------------------------------
async function loadAudit() {
  const list = await api("GET", "audit?limit=200");
  const rows = $("audit-rows");
  rows.replaceChildren();
  for (const ev of list.data) {
    rows.append(el("tr", {}, el("td", {}, ev.ts.replace("T", " ").slice(0, 19)), el("td", {}, ev.action),
      el("td", {}, el("code", {}, ev.target)), el("td", {}, ev.actor),
      el("td", {}, JSON.stringify(ev.details || {}))));
  }
}

// -- bus -------------------------------------------------------------------------------
function bytes(n) {
  if (n === null || n === undefined) return "";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

function placement(c) {
  if (!c) return "";
  const peers = c.replicas.map((p) => `${p.name}${p.current ? "" : ` (lag ${p.lag ?? "?"})`}`);
  return ` leader ${c.leader || "none"}${peers.length ? "; " + peers.join(", ") : ""}`;
}

async function loadBus() {
  renderBus(await api("GET", "bus"));
}

// Drawn from the Bus API (Refresh, opening the page) and from the feed's `bus` events.
function renderBus(bus) {
  const alerts = $("bus-alerts");
  alerts.replaceChildren();
  for (const a of bus.alerts) {
    alerts.append(el("li", { class: a.severity === "critical" ? "state-off" : "warn", "data-alert": a.alert },
      el("strong", {}, a.alert), ` (${a.severity}): ${a.summary}`));
  }
  if (!bus.alerts.length) alerts.append(el("li", { class: "state-on" }, "None of the conditions this page evaluates."));
  const servers = $("bus-servers");
  servers.replaceChildren();
  for (const s of bus.servers) {
    const storage = s.js_max_storage ? `${bytes(s.js_storage)} of ${bytes(s.js_max_storage)}` : "";
    servers.append(el("tr", { "data-server": s.url },
      el("td", {}, s.name || "", " ", el("code", {}, s.url)),
      el("td", { class: s.up ? "state-on" : "state-off" }, s.up ? "up" : "down"),
      el("td", {}, s.version || ""), el("td", {}, String(s.connections ?? "")), el("td", {}, String(s.routes ?? "")),
      el("td", { class: s.slow_consumers ? "state-off" : "" }, String(s.slow_consumers ?? "")),
      el("td", {}, bytes(s.mem)), el("td", {}, s.up ? `${s.cpu}%` : ""), el("td", {}, storage)));
  }
  if (!bus.servers.length) {
    servers.append(el("tr", {}, el("td", { colspan: "9" }, "No monitoring URL is set (telemetry.nats_monitor_urls).")));
  }
  const streams = $("bus-streams");
  streams.replaceChildren();
  for (const st of bus.streams) {
    const list = el("ul", { class: "plain" });
    for (const c of st.consumers) {
      list.append(el("li", { "data-consumer": c.name, class: c.num_pending > 0 ? "warn" : "" },
        el("code", {}, c.name), `: ${c.num_pending} / ${c.num_ack_pending}${placement(c.cluster)}`));
    }
    if (st.consumer_count > st.consumers.length) list.append(el("li", {}, `… ${st.consumer_count - st.consumers.length} more`));
    if (st.consumers_error) list.append(el("li", { class: "state-off" }, st.consumers_error));
    streams.append(el("tr", { "data-stream": st.name },
      el("td", {}, el("code", {}, st.name)), el("td", {}, String(st.messages)), el("td", {}, bytes(st.bytes)),
      el("td", {}, `${st.replicas}${placement(st.cluster)}`), el("td", {}, list)));
  }
  const notes = [];
  if (bus.streams_error) notes.push(bus.streams_error);
  if (bus.truncated) notes.push(`showing ${bus.streams.length} of ${bus.streams_total} streams`);
  $("bus-note").textContent = notes.join("; ");
  const now = new Date();
  $("bus-updated").textContent = `updated ${now.toLocaleTimeString()}`;
  $("bus-updated").dataset.at = String(now.getTime());
}

$("bus-refresh").addEventListener("click", () => loadBus().catch((e) => say(e.message, true)));

// -- the live feed: one EventSource per open page ---------------------------------------
// The Bus page's live part costs the bridge a shared read every few seconds: the feed carries
// it only while the page shows it (?page=bus), so the feed is opened again on entering and on
// leaving that page. Still one feed per open page.
function feedPage() { return state.page === "bus" ? "bus" : ""; }

function live(on) { for (const b of document.querySelectorAll(".live")) b.classList.toggle("off", !on); }

function startFeed() {
  stopFeed();
  const page = feedPage();
  const es = new EventSource("/console/api/events" + (page ? `?page=${page}` : ""));
  state.feed = es;
  state.feedPage = page;
  es.addEventListener("open", () => live(true));
  es.addEventListener("error", () => live(false)); // it reconnects itself
  es.addEventListener("replicas", (ev) => { if (state.page === "replicas") renderReplicas(JSON.parse(ev.data)); });
  es.addEventListener("bus", (ev) => { if (state.page === "bus") renderBus(JSON.parse(ev.data)); });
  es.addEventListener("keys", () => { if (state.page === "keys") loadKeys().catch(() => {}); });
  es.addEventListener("end", () => { showLogin("Your session ended: log in again."); });
}

function stopFeed() {
  if (state.feed) { state.feed.close(); state.feed = null; live(false); }
}

// A page left (reloaded, navigated away, kept in the back-forward cache) closes its feed: an
// open one holds one of the browser's six connections to this host, and a few reloads'
// worth made the next request wait for a free one (docs/console.md, "Speed").
window.addEventListener("pagehide", stopFeed);
window.addEventListener("pageshow", (ev) => { if (ev.persisted && state.me) startFeed(); });

// -- start -----------------------------------------------------------------------------
api("GET", "session").then(loggedIn, () => showLogin());
