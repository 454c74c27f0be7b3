// The queue (#/queue): every waiting job and selection group in the scheduler's order (GET /api/queue
// runs the scheduler's own ordering), with the reason it waits, its owner and how long it has waited.
import { api, type QueueEntry, type QueuePage } from "../api";
import { clock, errorText, gridTable, h } from "../dom";
import { currentUser } from "../main";

const POLL_MS = 3000;

export function queuePage(root: HTMLElement): () => void {
  const tbody = h("tbody");
  const summary = h("p", { class: "muted", id: "queue-summary" }, "loading…");
  root.append(
    h("section", {}, h("div", { class: "title-row" }, h("h1", {}, "Queue")), summary),
    gridTable(
      { id: "queue-table" },
      ["#", "job", "owner", "priority", "ranks", "waited", "why it waits"],
      tbody,
    ),
  );
  let items: QueueEntry[] = [];
  let fetchedAt = Date.now();

  const waited = (e: QueueEntry) => clock(e.waited_s + (Date.now() - fetchedAt) / 1000);

  const row = (e: QueueEntry) =>
    h(
      "tr",
      { "data-job-id": e.job_id, "data-position": e.position },
      h("td", { class: "num", "data-col": "position" }, e.position),
      h(
        "td",
        { "data-col": "job" },
        e.selection_id != null
          ? h(
              "span",
              {},
              h("a", { href: `#/selections/${e.selection_id}` }, `batch #${e.selection_id}`),
              ` · group of ${e.trial_ids?.length ?? 0} trial(s), first `,
              h("a", { href: `#/jobs/${e.job_id}` }, `#${e.job_id}`),
            )
          : h("a", { href: `#/jobs/${e.job_id}` }, `#${e.job_id} · ${e.name}`),
      ),
      h("td", { class: "owner", "data-col": "owner" }, e.owner ?? "—"),
      h(
        "td",
        { class: "num", "data-col": "priority", title: "effective priority: the job's own plus its age" },
        e.priority === e.effective_priority ? e.priority : `${e.priority} (${e.effective_priority})`,
      ),
      h("td", { class: "num", "data-col": "ranks" }, e.world_size),
      h("td", { class: "num waited", "data-col": "waited" }, waited(e)),
      h("td", { class: "wait-reason", "data-col": "reason" }, e.wait_reason ?? "placing it now"),
    );

  const load = async () => {
    try {
      const page = await api<QueuePage>("/api/queue");
      items = page.items;
      fetchedAt = Date.now();
      tbody.replaceChildren(...items.map(row));
      if (!items.length)
        tbody.append(h("tr", {}, h("td", { colspan: 7, class: "muted" }, "Nothing is waiting.")));
      const mine = currentUser()?.user.is_admin ? "" : `; yours: ${items.length}`;
      summary.textContent = `${page.total} waiting in all${mine}. Ordered as the scheduler places them.`;
    } catch (err) {
      summary.className = "error";
      summary.textContent = `could not load the queue: ${errorText(err)}`;
    }
  };
  // the waited clocks tick between polls
  const tick = window.setInterval(() => {
    for (const tr of tbody.querySelectorAll<HTMLTableRowElement>("tr[data-job-id]")) {
      const e = items.find((i) => String(i.job_id) === tr.dataset.jobId);
      const td = tr.querySelector("td.waited");
      if (e && td) td.textContent = waited(e);
    }
  }, 1000);
  void load();
  const poll = window.setInterval(load, POLL_MS);
  return () => {
    window.clearInterval(poll);
    window.clearInterval(tick);
  };
}
