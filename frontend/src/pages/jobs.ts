// Jobs list: one page of the table at a time, filtered on the server (status, owner, name) so it
// stays fast with many thousands of jobs; live updates from the global event stream; a submit form.
import { api, type Job, type JobsPage, type JobsStreamEvents, post, subscribe, TERMINAL } from "../api";
import {
  badge,
  clock,
  divergedBadge,
  errorText,
  fmtNum,
  fmtTime,
  gridTable,
  h,
  parsedJson,
  progressBar,
} from "../dom";
import { specTools } from "../workspace";
import { compareHref, MAX_COMPARE } from "./compare";

const POLL_MS = 5000;
const PAGE = 50;
const STATUSES = ["", "queued", "running", "succeeded", "failed", "cancelled"];

export const DEFAULT_SPEC = {
  name: "tiny-gpt",
  model: { kind: "gpt", layers: 2, d_model: 64, heads: 4, seq_len: 32 },
  data: { kind: "text", corpus: "stdlib" },
  train: { steps: 100, batch_size: 16, lr: 0.001, optimizer: "adamw", seed: 0, eval_every: 20 },
};

/** The latest training loss we know of: live progress first, else the final result. */
export function jobLoss(job: Job): number | null {
  const r = (job.result ?? {}) as Record<string, unknown>;
  const candidates = [job.progress?.loss, r.final_loss, r.loss];
  const v = candidates.find((c) => typeof c === "number");
  return typeof v === "number" ? v : null;
}

export function jobsPage(root: HTMLElement): () => void {
  const jobs = new Map<number, Job>();
  const tbody = h("tbody");
  const note = h("div", { class: "muted", id: "live-state" }, "connecting…");
  const pageInfo = h("span", { id: "jobs-page-info", class: "muted" }, "");
  let poll: number | null = null;
  let offset = 0;
  let total = 0;
  let reloadTimer: number | null = null;
  // jobs ticked for the compare view; kept across pages and filters
  const picked = new Set<number>();
  const compareBtn = h("a", { class: "button small", id: "compare-picked", href: "#/compare" }, "Compare");
  const showPicked = () => {
    compareBtn.textContent = `Compare ${picked.size}/${MAX_COMPARE}`;
    compareBtn.setAttribute("href", compareHref([...picked]));
    compareBtn.classList.toggle("disabled", picked.size === 0);
    for (const box of tbody.querySelectorAll<HTMLInputElement>("input[data-pick]"))
      box.disabled = !box.checked && picked.size >= MAX_COMPARE;
  };
  const pick = (id: number, on: boolean) => {
    if (on && picked.size < MAX_COMPARE) picked.add(id);
    else picked.delete(id);
    showPicked();
  };

  const statusSel = h(
    "select",
    { id: "filter-status", onchange: () => refilter() },
    ...STATUSES.map((s) => h("option", { value: s }, s || "any status")),
  );
  const ownerIn = h("input", {
    id: "filter-owner",
    placeholder: "owner",
    size: 12,
    oninput: () => refilter(),
  });
  const nameIn = h("input", {
    id: "filter-name",
    placeholder: "name contains",
    size: 18,
    oninput: () => refilter(),
  });
  const prev = h(
    "button",
    { class: "small secondary", id: "page-prev", onclick: () => turn(-PAGE) },
    "‹ Newer",
  );
  const next = h(
    "button",
    { class: "small secondary", id: "page-next", onclick: () => turn(PAGE) },
    "Older ›",
  );

  const query = () => {
    const q = new URLSearchParams({ limit: String(PAGE), offset: String(offset) });
    if (statusSel.value) q.set("status", statusSel.value);
    if (ownerIn.value.trim()) q.set("owner", ownerIn.value.trim());
    if (nameIn.value.trim()) q.set("name", nameIn.value.trim());
    return q;
  };

  /** Does a job from the live stream belong on the page the filters show? */
  const matches = (job: Job) =>
    (!statusSel.value || job.status === statusSel.value) &&
    (!ownerIn.value.trim() || job.owner === ownerIn.value.trim()) &&
    (!nameIn.value.trim() || job.name.toLowerCase().includes(nameIn.value.trim().toLowerCase()));

  const turn = (delta: number) => {
    offset = Math.max(0, Math.min(offset + delta, Math.max(0, total - 1)));
    void load();
  };

  const refilter = () => {
    offset = 0;
    if (reloadTimer !== null) window.clearTimeout(reloadTimer);
    reloadTimer = window.setTimeout(() => void load(), 250);
  };

  /** Reload the page from the server soon, once for a burst of live events. */
  const reloadSoon = () => {
    if (reloadTimer === null) reloadTimer = window.setTimeout(() => void load(), 300);
  };

  /** The reserved worker(s) of a placed job, else the worker that ran it. */
  const placement = (job: Job): string => {
    const held = job.reservation ?? [];
    if (held.length > 1) return held.map((r) => `${r.worker} (${r.slots})`).join(", ");
    return held[0]?.worker ?? job.worker ?? "—";
  };

  const row = (job: Job): HTMLTableRowElement => {
    const active = !TERMINAL.has(job.status);
    const steps = job.progress?.steps ?? (job.spec?.train as { steps?: number } | undefined)?.steps ?? 0;
    const step = job.progress?.step ?? (job.status === "succeeded" ? steps : 0);
    return h(
      "tr",
      { "data-job-id": job.id, "data-status": job.status },
      h(
        "td",
        {},
        h("input", {
          type: "checkbox",
          "data-pick": job.id,
          "aria-label": `compare job ${job.id}`,
          checked: picked.has(job.id),
          disabled: !picked.has(job.id) && picked.size >= MAX_COMPARE,
          onchange: (ev: Event) => pick(job.id, (ev.target as HTMLInputElement).checked),
        }),
        " ",
        h("a", { href: `#/jobs/${job.id}` }, job.id),
      ),
      h("td", {}, h("a", { href: `#/jobs/${job.id}` }, job.name)),
      h("td", { class: "owner" }, job.owner ?? "—"),
      h(
        "td",
        { "data-col": "status" },
        // a trial's job ends "succeeded" when the rungs stopped it early: say so
        badge(job.stopped_early ? "stopped_early" : job.status),
        job.diverged ? " " : null,
        divergedBadge(job),
        job.cancel_requested && active ? h("span", { class: "muted" }, " cancelling…") : null,
        job.status === "queued" && job.queue_position
          ? h("span", { class: "muted queue-position" }, ` #${job.queue_position} in queue`)
          : null,
        job.wait_reason && (job.status === "queued" || job.status === "running")
          ? h("div", { class: "muted wait-reason" }, `waiting: ${job.wait_reason}`)
          : null,
        // the first line of why it failed; the whole message is the tooltip and the job page's
        job.status === "failed" && job.error
          ? h("div", { class: "row-error", title: job.error }, job.error.split("\n")[0])
          : null,
      ),
      h("td", {}, progressBar(step, steps)),
      h("td", { class: "num" }, fmtNum(jobLoss(job))),
      h("td", {}, fmtTime(job.created_at)),
      h("td", { class: "num duration" }, duration(job)),
      h("td", { class: "placement" }, placement(job)),
      h(
        "td",
        {},
        active && !job.cancel_requested
          ? h(
              "button",
              { class: "small danger", "data-cancel": job.id, onclick: () => cancel(job) },
              "Cancel",
            )
          : null,
      ),
    );
  };

  const render = () => {
    const sorted = [...jobs.values()].sort((a, b) => b.id - a.id);
    tbody.replaceChildren(...sorted.map(row));
    if (!sorted.length) tbody.append(h("tr", {}, h("td", { colspan: 10, class: "muted" }, "No jobs.")));
    pageInfo.textContent = total ? `${offset + 1}–${offset + sorted.length} of ${total}` : "0 jobs";
    prev.toggleAttribute("disabled", offset === 0);
    next.toggleAttribute("disabled", offset + PAGE >= total);
  };

  const upsert = (job: Job) => {
    const old = tbody.querySelector(`tr[data-job-id="${job.id}"]`);
    if (old && matches(job)) {
      jobs.set(job.id, job);
      old.replaceWith(row(job));
    } else if (old || (offset === 0 && matches(job))) {
      reloadSoon(); // it joins or leaves this page: let the server page it
    }
  };

  const load = async () => {
    if (reloadTimer !== null) window.clearTimeout(reloadTimer);
    reloadTimer = null;
    try {
      const page = await api<JobsPage>(`/api/jobs?${query()}`);
      jobs.clear();
      for (const j of page.items) jobs.set(j.id, j);
      total = page.total;
      render();
    } catch (err) {
      note.textContent = `could not load jobs: ${errorText(err)}`;
    }
  };

  const cancel = async (job: Job) => {
    if (!window.confirm(`Cancel job #${job.id} (${job.name})? Its training stops and cannot be resumed.`))
      return;
    try {
      upsert(await post<Job>(`/api/jobs/${job.id}/cancel`));
    } catch (err) {
      alert(`Cancel failed: ${errorText(err)}`);
    }
  };

  /** A job deleted (by an admin): off the table at once, then the page refilled by the server. */
  const drop = (d: JobsStreamEvents["deleted"]) => {
    tbody.querySelector(`tr[data-job-id="${d.job_id}"]`)?.remove();
    if (jobs.delete(d.job_id)) reloadSoon();
  };

  // live updates; if the stream drops, poll until it is back (EventSource reconnects by itself).
  // `resync`: the server lost changes (its broker restarted), so reload the page from the API
  const events = subscribe<JobsStreamEvents>(
    "/api/events",
    { job: upsert, deleted: drop, resync: () => void load() },
    (state) => {
      if (state === "open") {
        note.textContent = "live";
        if (poll !== null) window.clearInterval(poll);
        poll = null;
        void load(); // catch up on whatever changed while disconnected
      } else if (poll === null) {
        note.textContent = `stream lost, polling every ${POLL_MS / 1000} s`;
        poll = window.setInterval(load, POLL_MS);
      }
    },
  );

  root.append(
    h("section", {}, h("div", { class: "title-row" }, h("h1", {}, "Jobs"), note)),
    h(
      "div",
      { class: "filters", id: "jobs-filters" },
      statusSel,
      ownerIn,
      nameIn,
      prev,
      pageInfo,
      next,
      compareBtn,
    ),
    gridTable(
      { id: "jobs-table" },
      ["id", "name", "owner", "status", "progress", "loss", "created", "duration", "worker", ""],
      tbody,
    ),
    submitForm(upsert, cloneOf()),
  );
  void load();
  showPicked();

  return () => {
    events.close();
    if (poll !== null) window.clearInterval(poll);
    if (reloadTimer !== null) window.clearTimeout(reloadTimer);
  };
}

/** The job whose spec the submit form starts from (#/?clone=ID: clone / re-run), if any. */
function cloneOf(): number | null {
  const hash = window.location.hash;
  const i = hash.indexOf("?");
  return Number(new URLSearchParams(i >= 0 ? hash.slice(i + 1) : "").get("clone")) || null;
}

function submitForm(onSubmitted: (job: Job) => void, clone: number | null): HTMLElement {
  const text = h("textarea", { id: "spec-input", rows: 14, spellcheck: "false" }) as HTMLTextAreaElement;
  text.value = JSON.stringify(DEFAULT_SPEC, null, 2);
  const out = h("div", { id: "submit-result", role: "status" });
  const origin = h("p", { class: "muted", id: "submit-origin", hidden: true });
  const submit = async (ev: Event) => {
    ev.preventDefault();
    out.className = "";
    out.textContent = "";
    const spec = parsedJson(text.value, out);
    if (spec === null) return;
    try {
      const job = await post<Job>("/api/jobs", spec.value);
      onSubmitted(job);
      out.className = "ok";
      out.replaceChildren("Submitted ", h("a", { href: `#/jobs/${job.id}` }, `job #${job.id}`), ".");
    } catch (err) {
      out.className = "error";
      out.textContent = errorText(err);
    }
  };
  const form = h(
    "form",
    { class: "card", id: "submit-form", onsubmit: submit },
    h("h2", {}, "Submit job"),
    origin,
    specTools(text),
    h("label", { for: "spec-input", class: "muted" }, "JobSpec (JSON)"),
    text,
    h(
      "div",
      { class: "form-row" },
      h("button", { type: "submit" }, "Submit job"),
      h(
        "button",
        {
          type: "button",
          class: "secondary",
          onclick: () => (text.value = JSON.stringify(DEFAULT_SPEC, null, 2)),
        },
        "Reset",
      ),
    ),
    out,
  );
  if (clone !== null) {
    // the spec as the job stored it (its workspace pinned by digest): submitted again, it trains the same
    void api<Job>(`/api/jobs/${clone}`)
      .then((job) => {
        text.value = JSON.stringify(job.spec, null, 2);
        origin.hidden = false;
        origin.replaceChildren(
          "The spec of ",
          h("a", { href: `#/jobs/${job.id}` }, `job #${job.id} · ${job.name}`),
          ": change what you like and submit it again.",
        );
        form.scrollIntoView({ block: "start" });
      })
      .catch((err) => {
        out.className = "error";
        out.textContent = `Could not load job #${clone} to clone: ${errorText(err)}`;
      });
  }
  return form;
}

/** How long a job ran (all its attempts), or for one not started yet, how long it has waited. */
function duration(job: Job): string {
  if (job.started_at) return clock(job.run_seconds ?? 0);
  if (job.status !== "queued" || !job.created_at) return "—";
  return `waiting ${clock((Date.now() - Date.parse(job.created_at)) / 1000)}`;
}
