// Rollouts: filters, id search, cursor pagination, live row updates, cancel and requeue actions.

import { api, query } from "./api.js";
import { badge, clear, confirmDialog, fmtDuration, fmtNum, fmtTime, h, idText, rolloutLink, shortId, table, toast } from "./ui.js";

const STATUSES = ["queuing", "preparing", "running", "succeeded", "failed", "cancelled"];
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
const FILTERS = ["status", "mode", "batch_id", "worker_id", "search"];
const trail = { key: "", cursors: [] }; // cursors of the pages before this one, for "Newer"

function filterKey(p) {
  return FILTERS.map((k) => p[k] || "").join("|") + `|${p.limit || ""}`;
}

function go(params) {
  const clean = Object.fromEntries(Object.entries(params).filter(([, v]) => v));
  location.hash = `#/rollouts${query(clean)}`;
}

export function matches(row, p) {
  if (p.status && row.status !== p.status) return false;
  if (p.mode && row.mode !== p.mode) return false;
  if (p.batch_id && row.batch_id !== p.batch_id) return false;
  if (p.worker_id && row.worker_id !== p.worker_id) return false;
  if (p.search && !row.rollout_id.startsWith(p.search)) return false;
  return true;
}

function duration(r, now) {
  if (!r.started_at) return null;
  return (r.finished_at || (TERMINAL.has(r.status) ? r.updated_at : now)) - r.started_at;
}

export function mount(root, { params, live }) {
  const p = { limit: "50", ...params };
  if (trail.key !== filterKey(p)) Object.assign(trail, { key: filterKey(p), cursors: [] });
  const tbody = h("tbody", { id: "rollout-rows" });
  const info = h("span", { class: "muted", id: "page-info" });
  const workerSelect = h("select", { name: "worker_id", id: "f-worker" });
  const form = filters(p, workerSelect);
  const newer = h("button", { id: "page-newer", disabled: !p.cursor, onclick: () => go({ ...p, cursor: trail.cursors.pop() || "" }) }, "← Newer");
  const older = h("button", { id: "page-older", disabled: true }, "Older →");
  const head = ["id", "status", "mode", "batch", "attempts", "worker", "started", "duration", "reward", ""];
  clear(
    root,
    h("div", { class: "title-row" }, h("h1", {}, "Rollouts"), h("button", { id: "requeue", onclick: requeueStuck }, "Requeue stuck…")),
    form,
    h("table", { class: "grid rollouts" }, h("thead", {}, h("tr", {}, head.map((x) => h("th", {}, x)))), tbody),
    h("div", { class: "pager" }, newer, info, older),
  );
  let dead = false;
  let next = null;
  let inflight = null;
  let again = false;
  let marked = false;

  function row(r) {
    const now = live.now();
    const active = !TERMINAL.has(r.status);
    return h(
      "tr",
      { dataset: { id: r.rollout_id, status: r.status } },
      h("td", { class: "rid" }, rolloutLink(r.rollout_id)),
      h("td", { class: "status", title: r.error || null }, badge(r.status)),
      h("td", {}, r.mode || "–"),
      h("td", { class: "batch" }, idText(r.batch_id)),
      h("td", { class: "num" }, r.attempts, r.suspect ? h("span", { class: "badge s-failed suspect", title: "suspected poison: lost on several different runners in a row" }, "!") : null),
      h("td", { class: "worker" }, idText(r.worker_id)),
      h("td", {}, fmtTime(r.started_at || r.created_at)),
      h("td", { class: "num" }, fmtDuration(duration(r, now))),
      h("td", { class: "num" }, r.reward === null ? "–" : fmtNum(r.reward)),
      h("td", {}, active ? h("button", { class: "small danger cancel", onclick: () => cancel(r.rollout_id) }, "Cancel") : null),
    );
  }

  async function load() {
    if (inflight) {
      again = true;
      return inflight;
    }
    inflight = (async () => {
      try {
        const page = await api(`/dashboard/api/rollouts${query({ ...Object.fromEntries(FILTERS.map((k) => [k, p[k]])), cursor: p.cursor, limit: p.limit })}`);
        if (dead) return;
        clear(tbody, page.items.map(row));
        if (!page.items.length) tbody.append(h("tr", { class: "empty" }, h("td", { colspan: head.length }, "No rollout matches these filters.")));
        next = page.next_cursor;
        older.disabled = !next;
        older.onclick = () => {
          trail.cursors.push(p.cursor || "");
          go({ ...p, cursor: next });
        };
        const n = trail.cursors.length + 1;
        clear(info, `page ${n} · ${page.items.length} row${page.items.length === 1 ? "" : "s"}`, total());
        if (!marked) {
          marked = true;
          performance.mark("rollouts-rendered");
        }
      } catch (err) {
        if (!dead) clear(tbody, h("tr", {}, h("td", { colspan: head.length, class: "error" }, `Could not load rollouts: ${err.message}`)));
      } finally {
        inflight = null;
        if (again && !dead) {
          again = false;
          load();
        }
      }
    })();
    return inflight;
  }

  function total() {
    const stats = live.state.stats;
    if (!stats || FILTERS.some((k) => k !== "status" && p[k])) return "";
    return ` of ${p.status ? stats.rollouts[p.status] : stats.total_rollouts}`;
  }

  async function cancel(id) {
    const ok = await confirmDialog("Cancel rollout?", h("p", {}, "Cancel ", h("code", {}, id), "? A running attempt is told to stop; this cannot be undone."), "Cancel rollout");
    if (!ok) return;
    try {
      await api(`/rollouts/${encodeURIComponent(id)}/cancel`, { method: "POST" });
      toast(`Cancelled ${shortId(id)}`, "ok");
      load();
    } catch (err) {
      toast(`Cancel failed: ${err.message}`, "bad");
    }
  }

  function fillWorkers() {
    const ids = (live.state.workers || []).map((w) => w.worker_id);
    if (p.worker_id && !ids.includes(p.worker_id)) ids.push(p.worker_id);
    const have = [...workerSelect.options].map((o) => o.value).slice(1).join("|");
    if (have === ids.join("|")) return;
    clear(workerSelect, h("option", { value: "" }, "any worker"), ids.map((id) => h("option", { value: id }, id)));
    workerSelect.value = p.worker_id || "";
  }

  const onLive = (kind, msg) => {
    if (kind === "snapshot" || msg.workers) fillWorkers();
    if ((kind === "snapshot" && live.snapshots > 1) || msg.truncated) return void load();
    if (!msg.rollouts) return;
    let refetch = false;
    for (const r of msg.rollouts) {
      const old = tbody.querySelector(`tr[data-id="${CSS.escape(r.rollout_id)}"]`);
      if (old) {
        const fresh = row(r);
        fresh.classList.add("flash");
        old.replaceWith(fresh);
        if (!p.cursor && !matches(r, p)) refetch = true;
      } else if (!p.cursor && matches(r, p)) refetch = true;
    }
    if (refetch) load();
  };
  live.listeners.add(onLive);
  fillWorkers();
  load();
  return {
    unmount() {
      dead = true;
      live.listeners.delete(onLive);
    },
  };
}

function filters(p, workerSelect) {
  const status = h("select", { name: "status", id: "f-status" }, h("option", { value: "" }, "any status"), STATUSES.map((s) => h("option", { value: s }, s)));
  status.value = p.status || "";
  const text = (name, placeholder) => h("input", { name, id: `f-${name}`, placeholder, value: p[name] || "", size: 14 });
  const limit = h("select", { name: "limit", id: "f-limit" }, ["25", "50", "100", "200"].map((n) => h("option", { value: n }, `${n} / page`)));
  limit.value = p.limit;
  const apply = () => {
    const values = Object.fromEntries(new FormData(form).entries());
    go({ ...values });
  };
  const form = h(
    "form",
    { class: "filters", id: "filters", onsubmit: (ev) => (ev.preventDefault(), apply()) },
    status,
    text("mode", "mode"),
    text("batch_id", "batch id"),
    workerSelect,
    text("search", "search id (prefix)"),
    limit,
    h("button", { type: "submit" }, "Apply"),
    h("button", { type: "button", onclick: () => go({ limit: p.limit }) }, "Clear"),
  );
  for (const sel of [status, workerSelect, limit]) sel.addEventListener("change", apply);
  return form;
}

async function requeueStuck() {
  const prep = h("input", { type: "checkbox", id: "rq-preparing", checked: true });
  const run = h("input", { type: "checkbox", id: "rq-running" });
  const age = h("input", { type: "number", id: "rq-older", min: "0", value: "60", size: 6 });
  const body = h(
    "div",
    { class: "stack" },
    h("p", {}, "Put rollouts that are stuck back in the queue (their attempts are ended and fenced)."),
    h("label", {}, prep, " PREPARING"),
    h("label", {}, run, " RUNNING"),
    h("label", {}, "not updated for at least ", age, " seconds"),
  );
  if (!(await confirmDialog("Requeue stuck rollouts?", body, "Requeue"))) return;
  const statuses = [prep.checked && "preparing", run.checked && "running"].filter(Boolean);
  if (!statuses.length) return toast("Nothing selected", "bad");
  try {
    const res = await api("/rollouts/requeue", { method: "POST", body: { statuses, older_than_s: Number(age.value) || 0 } });
    toast(`Requeued ${res.rollout_ids.length} rollouts`, "ok");
  } catch (err) {
    toast(`Requeue failed: ${err.message}`, "bad");
  }
}
