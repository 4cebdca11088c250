// Runners: every worker with its status, current rollouts, last heartbeat, counters and throughput.

import { badge, card, clear, compact, fmtAgo, fmtDateTime, fmtNum, h, idText, rolloutLink, table } from "./ui.js";

export function mount(root, { live }) {
  const summary = h("section", { class: "cards" });
  const body = h("section", { id: "runners" });
  clear(root, h("h1", {}, "Runners"), summary, body);

  function render() {
    const workers = live.state.workers;
    if (!workers) {
      clear(body, h("p", { class: "muted" }, "Waiting for the live stream…"));
      return;
    }
    const count = (s) => workers.filter((w) => w.status === s).length;
    clear(
      summary,
      card("workers", workers.length),
      card("BUSY", count("busy"), "s-busy"),
      card("IDLE", count("idle"), "s-idle"),
      card("OFFLINE", count("offline"), "s-offline"),
    );
    const now = live.now();
    const rows = workers.map((w) =>
      h(
        "tr",
        { dataset: { worker: w.worker_id, status: w.status } },
        h("td", { class: "worker" }, idText(w.worker_id)),
        h("td", { class: "status" }, badge(w.status)),
        h("td", { class: "current" }, w.current_rollouts.length ? w.current_rollouts.map((id) => [rolloutLink(id), " "]) : h("span", { class: "muted" }, "–")),
        h("td", { title: fmtDateTime(w.last_heartbeat_at) }, fmtAgo(w.last_heartbeat_at, now)),
        h("td", { class: "num" }, w.succeeded),
        h("td", { class: "num" }, w.failed),
        h("td", { class: "num", title: "lifetime average" }, fmtNum(w.recent_per_min ?? w.per_min, 1)),
        h("td", {}, h("a", { href: `#/rollouts?worker_id=${encodeURIComponent(w.worker_id)}` }, "rollouts")),
        h("td", { class: "muted small" }, compact(w.metadata)),
      ),
    );
    clear(
      body,
      table(
        ["worker", "status", "current rollouts", "last heartbeat", "done", "failed", "per min (5 min)", "", "metadata"],
        rows,
        { cls: "runners", empty: "No worker has registered yet. Start some with `rollfleet workers -n 4 --agent …`." },
      ),
    );
  }

  render();
  const onLive = (kind, msg) => {
    if (kind === "snapshot" || msg.workers) render();
  };
  live.listeners.add(onLive);
  return { unmount: () => live.listeners.delete(onLive) };
}
