// Rollout detail: input, attempts with their workers, errors and the turn each started at (what it
// took over from earlier attempts), the trajectory as a timeline (turns taken over marked), raw
// JSON on demand; reloads itself when the live stream says this rollout changed.

import { api, query } from "./api.js";
import { badge, clear, compact, confirmDialog, copyButton, fmtDateTime, fmtDuration, fmtNum, h, idText, json, table, toast } from "./ui.js";

const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);

async function allSteps(id) {
  const steps = [];
  let cursor = null;
  do {
    const page = await api(`/rollouts/${encodeURIComponent(id)}/steps${query({ cursor, limit: 1000 })}`);
    steps.push(...page.items);
    cursor = page.next_cursor;
  } while (cursor && steps.length < 5000);
  return steps;
}

export function mount(root, { arg: id, live }) {
  const body = h("div", { id: "detail" }, h("p", { class: "muted" }, "Loading…"));
  clear(root, h("p", {}, h("a", { href: "#/rollouts" }, "← Rollouts")), body);
  let dead = false;
  let loading = false;

  async function load() {
    if (loading) return;
    loading = true;
    try {
      const [r, attempts, steps] = await Promise.all([
        api(`/rollouts/${encodeURIComponent(id)}`),
        api(`/dashboard/api/rollouts/${encodeURIComponent(id)}/attempts`),
        allSteps(id),
      ]);
      if (!dead) render(body, r, attempts.items, steps, load);
    } catch (err) {
      if (!dead) clear(body, h("h1", {}, "Rollout"), h("p", { class: "error" }, err.status === 404 ? `No rollout ${id}.` : `Could not load: ${err.message}`));
    } finally {
      loading = false;
    }
  }

  const onLive = (kind, msg) => {
    if (msg.truncated || (msg.rollouts && msg.rollouts.some((r) => r.rollout_id === id))) load();
  };
  live.listeners.add(onLive);
  load();
  return {
    unmount() {
      dead = true;
      live.listeners.delete(onLive);
    },
  };
}

function render(body, r, attempts, steps, reload) {
  const active = !TERMINAL.has(r.status);
  const facts = [
    ["status", badge(r.status)],
    ["mode", r.mode || "–"],
    ["batch", r.batch_id || "–"],
    ["group", r.group_id || "–"],
    ["priority", r.priority],
    ["attempts", `${r.num_attempts} (failed ${r.attempts_charged} of ${r.config.max_attempts}, lost with their runner ${r.attempts_lost} of ${r.config.max_lost})`],
    r.suspect ? ["suspect", h("span", { class: "badge s-failed", id: "suspect", title: "lost on several different runners in a row: it may be what kills them" }, "suspected poison")] : null,
    ["created", fmtDateTime(r.created_at)],
    ["finished", fmtDateTime(r.finished_at)],
    ["reward", r.result && r.result.reward !== null ? fmtNum(r.result.reward) : "–"],
    ["metrics", r.result ? compact(r.result.metrics) : "–"],
    mergeBreaks(r, steps),
  ];
  const cancel = async () => {
    if (!(await confirmDialog("Cancel rollout?", h("p", {}, "Cancel ", h("code", {}, r.rollout_id), "? This cannot be undone."), "Cancel rollout"))) return;
    try {
      await api(`/rollouts/${encodeURIComponent(r.rollout_id)}/cancel`, { method: "POST" });
      toast("Cancelled", "ok");
      reload();
    } catch (err) {
      toast(`Cancel failed: ${err.message}`, "bad");
    }
  };
  clear(
    body,
    h("div", { class: "title-row" }, h("h1", { class: "mono" }, r.rollout_id, copyButton(r.rollout_id)), active ? h("button", { class: "danger", id: "cancel-rollout", onclick: cancel }, "Cancel rollout") : null),
    h("dl", { class: "facts" }, facts.filter(Boolean).map(([k, v]) => [h("dt", {}, k), h("dd", { dataset: { fact: k } }, v)])),
    r.error ? h("pre", { class: "error-box" }, r.error) : null,
    h("h2", {}, "Input"),
    json(r.input),
    h("h2", {}, "Attempts"),
    attemptsTable(attempts),
    h("h2", {}, `Trajectory (${steps.length} steps)`),
    timeline(steps),
    r.result && r.result.output !== null && r.result.output !== undefined ? [h("h2", {}, "Output"), json(r.result.output)] : null,
    h("details", { class: "raw" }, h("summary", {}, "Raw JSON"), json({ rollout: r, attempts, steps })),
  );
}

// Calls of the latest attempt, after its first, that did not continue the conversation token-in:
// each starts a training row of its own (docs/train.md, "Token-in across turns").
function mergeBreaks(r, steps) {
  const attempt = r.attempt && r.attempt.attempt_id;
  const calls = steps.filter((s) => s.kind === "llm" && s.attempt_id === attempt && (s.payload || {}).finish_reason !== "abort");
  if (calls.length < 2) return null;
  const breaks = calls.slice(1).filter((s) => (s.payload || {}).token_in !== true).length;
  return ["merge breaks", h("span", { id: "merge-breaks", title: "calls that did not continue the conversation token-in" }, `${breaks} of ${calls.length - 1} continuing calls`)];
}

function attemptsTable(attempts) {
  const rows = attempts.map((a) =>
    h(
      "tr",
      {},
      h("td", { class: "num" }, a.sequence),
      h("td", { class: "mono" }, a.attempt_id, copyButton(a.attempt_id)),
      h("td", {}, idText(a.worker_id)),
      h("td", {}, badge(a.status)),
      h("td", {}, fmtDateTime(a.started_at)),
      h("td", { class: "num" }, fmtDuration(a.finished_at ? a.finished_at - a.started_at : null)),
      startCell(a),
      h("td", { class: "error" }, a.error || ""),
    ),
  );
  return table(["#", "attempt", "worker", "status", "started", "duration", "from turn", "error"], rows, { empty: "Not claimed yet." });
}

// Where an attempt started: turn 0, or the turn after those it took over from earlier attempts
// (its "resume" step: the strategy, what it reused, why it restarted when it did).
function startCell(a) {
  const s = a.start || { recorded: false, from_turn: 0 };
  const turn = h("span", { class: "start-turn" }, `turn ${s.from_turn}`);
  const attrs = { class: "start", dataset: { fromTurn: s.from_turn, strategy: s.strategy || "" } };
  if (!s.recorded) return h("td", attrs, turn, a.sequence > 1 ? h("div", { class: "muted small" }, "no resume step recorded") : null);
  const lines = [h("div", {}, turn, " ", h("span", { class: "tag strategy", title: "the mode's resume strategy" }, s.strategy || "?"))];
  if (s.restarted) {
    if (!s.reason || !s.reason.includes("restarted from turn 0")) lines.push(h("div", { class: "restarted" }, "restarted from turn 0"));
  } else {
    const from = s.from_attempts.length ? [" from ", s.from_attempts.flatMap((id, i) => (i ? [", ", idText(id)] : [idText(id)]))] : null;
    lines.push(h("div", { class: "reused small" }, `took over ${plural(s.from_turn, "turn")}`, from, `: reused ${plural(s.reused_calls, "call")}, ${plural(s.reused_results, "tool result")}`));
  }
  if (s.reason) lines.push(h("div", { class: `reason small${s.restarted ? " restarted" : ""}` }, s.reason));
  return h("td", attrs, lines);
}

function timeline(steps) {
  if (!steps.length) return h("p", { class: "muted" }, "No steps recorded.");
  const t0 = steps[0].timestamp;
  return h(
    "ol",
    { class: "timeline" },
    steps.map((s) => {
      const reused = (s.payload || {}).reused === true;
      const mark = reused ? h("span", { class: "tag reused", title: "taken over from an earlier attempt: the model was not asked again" }, "reused") : null;
      return h("li", { class: `step k-${s.kind}${reused ? " reused" : ""}` }, h("div", { class: "step-head" }, h("span", { class: "kind" }, s.kind), mark, h("span", { class: "muted" }, `+${fmtDuration(s.timestamp - t0)}`), stepSummary(s)), stepBody(s));
    }),
  );
}

function stepSummary(s) {
  const p = s.payload || {};
  const bits = [];
  if (Number.isInteger(p.turn)) bits.push(`turn ${p.turn}`);
  if (s.kind === "resume") bits.push(resumeSummary(p));
  const usage = p.usage || {};
  const prompt = usage.prompt_tokens ?? (p.prompt_token_ids ? p.prompt_token_ids.length : undefined);
  const completion = usage.completion_tokens ?? (p.completion_token_ids ? p.completion_token_ids.length : undefined);
  if (p.model) bits.push(p.model);
  if (prompt !== undefined) bits.push(`${prompt} prompt tokens`);
  if (completion !== undefined) bits.push(`${completion} completion tokens`);
  if (p.latency_s !== undefined) bits.push(`latency ${fmtDuration(p.latency_s)}`);
  if (p.token_in === true) bits.push("token-in");
  if (p.token_in === false) bits.push("merge break");
  if (p.latency_ms !== undefined) bits.push(`latency ${fmtDuration(p.latency_ms / 1000)}`);
  const reward = p.reward ?? (s.kind === "reward" ? p.value : undefined);
  if (reward !== undefined) bits.push(`reward ${fmtNum(reward)}`);
  if (p.name || p.tool) bits.push(`tool ${p.name || p.tool}`);
  return h("span", { class: "summary" }, bits.join(" · "));
}

function plural(n, word) {
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}

function resumeSummary(p) {
  const calls = Array.isArray(p.reused_calls) ? p.reused_calls.length : 0;
  return `${p.strategy || "?"}: from turn ${p.from_turn ?? 0}, reused ${plural(calls, "call")}, ${plural(p.reused_results ?? 0, "tool result")}`;
}

// Images in steps are stored once, by content: the step holds "rollfleet-blob:<sha256>", the bytes
// come from /blobs/<sha256> (with the bearer token, so not through a plain <img src>), once each.
const BLOB = "rollfleet-blob:";
const blobs = new Map();

function image(url) {
  const img = h("img", { class: "shot", alt: "image", title: "click to enlarge" });
  img.addEventListener("click", () => img.classList.toggle("big"));
  if (!url.startsWith(BLOB)) {
    if (!url.startsWith("data:image/")) return `[image ${url.slice(0, 80)}]`;  // never fetched
    img.src = url;
    return img;
  }
  const sha = url.slice(BLOB.length);
  if (!blobs.has(sha)) blobs.set(sha, api(`/blobs/${sha}`).then((b) => `data:${b.media_type};base64,${b.data}`));
  img.dataset.sha256 = sha;
  blobs.get(sha).then((src) => { img.src = src; }, () => { img.alt = "image not found"; });
  return img;
}

function content(c) {
  if (typeof c === "string") return c;
  if (c == null) return "";
  if (!Array.isArray(c)) return JSON.stringify(c);
  return c.map((part) => {
    if (part && part.type === "text") return part.text;
    if (part && part.type === "image_url" && part.image_url && typeof part.image_url.url === "string") return image(part.image_url.url);
    return JSON.stringify(part);
  });
}

function message(m) {
  const calls = (m.tool_calls || []).map((c) => {
    const fn = c.function || c;
    return h("div", { class: "tool-call" }, "→ ", h("b", {}, fn.name || "tool"), h("code", {}, typeof fn.arguments === "string" ? fn.arguments : JSON.stringify(fn.arguments ?? {})));
  });
  return h("div", { class: `msg role-${m.role || "unknown"}` }, h("span", { class: "role" }, m.role || "?"), h("span", { class: "content" }, content(m.content)), calls);
}

function stepBody(s) {
  const p = s.payload || {};
  const parts = [];
  if (Array.isArray(p.messages)) parts.push(h("div", { class: "msgs" }, p.messages.map(message)));
  if (p.role && p.content !== undefined) parts.push(message(p));
  if (p.text !== undefined && p.text !== null) parts.push(h("div", { class: "msg role-assistant" }, h("span", { class: "role" }, "completion"), h("span", { class: "content" }, p.text)));
  if (p.arguments !== undefined || p.args !== undefined) parts.push(h("div", { class: "tool-call" }, "args ", h("code", {}, JSON.stringify(p.arguments ?? p.args))));
  if (p.result !== undefined || p.output !== undefined) parts.push(h("div", { class: "tool-result" }, "result ", h("code", {}, compact(p.result ?? p.output))));
  if (!parts.length) parts.push(h("div", { class: "muted small" }, compact(p)));
  parts.push(h("details", {}, h("summary", {}, "raw"), json(s)));
  return h("div", { class: "step-body" }, parts);
}
