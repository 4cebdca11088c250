// Small DOM helpers shared by the pages: element builder, formatting, badges, dialogs, charts.

export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "value") el.value = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

export function clear(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

export function badge(status) {
  const s = status || "unknown";
  return h("span", { class: `badge s-${s}` }, s.toUpperCase());
}

export function fmtTime(t) {
  if (!t) return "–";
  const d = new Date(t * 1000);
  return d.toLocaleTimeString([], { hour12: false });
}

export function fmtDateTime(t) {
  if (!t) return "–";
  const d = new Date(t * 1000);
  return `${d.toLocaleDateString()} ${d.toLocaleTimeString([], { hour12: false })}`;
}

export function fmtAgo(t, now) {
  if (!t) return "–";
  const s = Math.max(0, now - t);
  if (s < 1) return "just now";
  if (s < 90) return `${Math.round(s)} s ago`;
  if (s < 5400) return `${Math.round(s / 60)} min ago`;
  return `${(s / 3600).toFixed(1)} h ago`;
}

export function fmtDuration(s) {
  if (s === null || s === undefined || !isFinite(s)) return "–";
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 120) return `${s.toFixed(1)} s`;
  if (s < 7200) return `${(s / 60).toFixed(1)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

export function fmtNum(x, digits = 3) {
  if (x === null || x === undefined) return "–";
  if (typeof x !== "number") return String(x);
  return Number.isInteger(x) ? String(x) : x.toFixed(digits);
}

// Ids are time-ordered ("ro-" + 12 hex of milliseconds + 16 random hex): rows made together share
// their start, so a long id keeps its kind ("ro-") and its tail, the part that tells rows apart;
// other long ids (host names…) keep a little of their start too.
const ID_FULL = 20; // ids up to this long are shown whole
const ID_TAIL = 8;
const GENERATED = /^([a-z]{1,5}-)[0-9a-f]{20,}$/i;

export function shortId(id) {
  if (!id) return "–";
  if (id.length <= ID_FULL) return id;
  const made = GENERATED.exec(id);
  return `${made ? made[1] : id.slice(0, ID_TAIL)}…${id.slice(-ID_TAIL)}`;
}

// Put text on the clipboard: the Clipboard API where the page may use it, else a hidden selection.
export async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) return navigator.clipboard.writeText(text);
  const area = h("textarea", { readonly: true, class: "offscreen", value: text });
  document.body.append(area);
  area.select();
  const ok = document.execCommand("copy");
  area.remove();
  if (!ok) throw new Error("the browser refused");
}

export function copyButton(id) {
  const copy = (ev) => {
    ev.preventDefault();
    ev.stopPropagation();
    copyText(id).then(
      () => toast(`Copied ${id}`, "ok"),
      (err) => toast(`Copy failed: ${err.message}`, "bad"),
    );
  };
  return h("button", { type: "button", class: "copy", title: `Copy ${id}`, "aria-label": "copy id", dataset: { copy: id }, onclick: copy }, copyIcon());
}

// Two overlapping sheets, drawn (a font may lack a copy glyph).
function copyIcon() {
  return svg(
    "svg",
    { viewBox: "0 0 16 16", width: 12, height: 12, "aria-hidden": "true" },
    svg("rect", { x: 5.5, y: 5.5, width: 8, height: 8, rx: 1.5 }),
    svg("path", { d: "M10.5 5.5V4A1.5 1.5 0 0 0 9 2.5H4A1.5 1.5 0 0 0 2.5 4v5A1.5 1.5 0 0 0 4 10.5h1.5" }),
  );
}

// An id as a table cell shows it: the telling part, the whole id on hover, a copy button; `href` links it.
export function idText(id, href) {
  if (!id) return "–";
  const text = href ? h("a", { href, class: "mono", title: id }, shortId(id)) : h("span", { class: "mono", title: id }, shortId(id));
  return h("span", { class: "id" }, text, copyButton(id));
}

export function rolloutLink(id) {
  return idText(id, `#/rollouts/${encodeURIComponent(id)}`);
}

export function json(value) {
  return h("pre", { class: "json" }, JSON.stringify(value, null, 2));
}

export function card(label, value, cls = "") {
  return h("div", { class: `card ${cls}` }, h("div", { class: "card-value" }, value), h("div", { class: "card-label" }, label));
}

export function table(headers, rows, { cls = "", empty = "Nothing to show." } = {}) {
  const body = h("tbody", {}, rows);
  if (!rows.length) body.append(h("tr", { class: "empty" }, h("td", { colspan: headers.length }, empty)));
  return h("table", { class: `grid ${cls}` }, h("thead", {}, h("tr", {}, headers.map((x) => h("th", {}, x)))), body);
}

export function toast(text, kind = "info") {
  const el = h("div", { class: `toast ${kind}`, role: "status" }, text);
  document.getElementById("toasts").append(el);
  setTimeout(() => el.remove(), 4000);
}

// A modal confirmation; resolves true only when the user confirms. `body` may hold inputs.
export function confirmDialog(title, body, confirmLabel = "Confirm") {
  const dlg = document.getElementById("confirm");
  clear(document.getElementById("confirm-title"), title);
  clear(document.getElementById("confirm-body"), body);
  document.getElementById("confirm-yes").textContent = confirmLabel;
  dlg.returnValue = "";
  dlg.showModal();
  return new Promise((resolve) => {
    dlg.addEventListener("close", () => resolve(dlg.returnValue === "ok"), { once: true });
  });
}

const SVG = "http://www.w3.org/2000/svg";

function svg(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  for (const c of children) el.append(c);
  return el;
}

// Stacked bars per minute: series = [{values, cls, label}], one value per bucket.
export function barChart(title, times, series, { height = 140 } = {}) {
  const width = 600;
  const n = times.length;
  const totals = times.map((_, i) => series.reduce((a, s) => a + (s.values[i] || 0), 0));
  const top = Math.max(1, ...totals);
  const bw = width / n;
  const chart = svg("svg", { viewBox: `0 0 ${width} ${height}`, class: "chart", preserveAspectRatio: "none" });
  times.forEach((t, i) => {
    let y = height;
    for (const s of series) {
      const v = s.values[i] || 0;
      if (!v) continue;
      const bh = (v / top) * (height - 10);
      y -= bh;
      const rect = svg("rect", { x: i * bw + 1, y, width: Math.max(1, bw - 2), height: bh, class: s.cls });
      rect.append(svg("title", {}, `${fmtTime(t)}: ${v} ${s.label}`));
      chart.append(rect);
    }
  });
  return chartFrame(title, chart, `max ${top}/min`, series);
}

export function lineChart(title, times, values, { height = 140, cls = "line-reward" } = {}) {
  const width = 600;
  const pts = values.map((v, i) => [i, v]).filter(([, v]) => v !== null && v !== undefined);
  const chart = svg("svg", { viewBox: `0 0 ${width} ${height}`, class: "chart", preserveAspectRatio: "none" });
  if (!pts.length) return chartFrame(title, chart, "no rewards yet", []);
  const lo = Math.min(...pts.map(([, v]) => v));
  const hi = Math.max(...pts.map(([, v]) => v));
  const span = hi - lo || 1;
  const x = (i) => (i + 0.5) * (width / times.length);
  const y = (v) => height - 8 - ((v - lo) / span) * (height - 16);
  chart.append(svg("polyline", { points: pts.map(([i, v]) => `${x(i)},${y(v)}`).join(" "), class: cls }));
  for (const [i, v] of pts) {
    const dot = svg("circle", { cx: x(i), cy: y(v), r: 3, class: cls });
    dot.append(svg("title", {}, `${fmtTime(times[i])}: ${v.toFixed(3)}`));
    chart.append(dot);
  }
  return chartFrame(title, chart, `${lo.toFixed(2)} – ${hi.toFixed(2)}`, []);
}

function chartFrame(title, chart, scale, series) {
  const legend = series.map((s) => h("span", { class: `legend ${s.cls}` }, s.label));
  return h("figure", { class: "chart-box" }, h("figcaption", {}, title, h("span", { class: "muted scale" }, scale), legend), chart);
}

// Render plain JSON-able values as compact text for generic tables.
export function compact(value) {
  if (value === null || value === undefined) return "–";
  if (typeof value === "number") return fmtNum(value);
  if (typeof value !== "object") return String(value);
  if (Array.isArray(value)) return value.map(compact).join(", ");
  return Object.entries(value).map(([k, v]) => `${k}=${compact(v)}`).join(" ");
}
