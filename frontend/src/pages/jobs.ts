// Jobs list: live table from the global event stream, a submit form, cancel buttons.
import { api, type Job, type Page, post, subscribe, TERMINAL } from "../api";
import { badge, errorText, fmtNum, fmtTime, h, progressBar } from "../dom";
import { specTools } from "../workspace";

const POLL_MS = 5000;

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
  let poll: number | null = null;

  const row = (job: Job): HTMLTableRowElement => {
    const active = !TERMINAL.has(job.status);
    const steps = job.progress?.steps ?? (job.spec?.train as { steps?: number } | undefined)?.steps ?? 0;
    const step = job.progress?.step ?? (job.status === "succeeded" ? steps : 0);
    return h(
      "tr",
      { "data-job-id": job.id, "data-status": job.status },
      h("td", {}, h("a", { href: `#/jobs/${job.id}` }, job.id)),
      h("td", {}, h("a", { href: `#/jobs/${job.id}` }, job.name)),
      h(
        "td",
        {},
        badge(job.status),
        job.cancel_requested && active ? h("span", { class: "muted" }, " cancelling…") : null,
      ),
      h("td", {}, progressBar(step, steps)),
      h("td", { class: "num" }, fmtNum(jobLoss(job))),
      h("td", {}, fmtTime(job.created_at)),
      h("td", {}, job.worker ?? "—"),
      h(
        "td",
        {},
        active && !job.cancel_requested
          ? h(
              "button",
              { class: "small danger", "data-cancel": job.id, onclick: () => cancel(job.id) },
              "Cancel",
            )
          : null,
      ),
    );
  };

  const render = () => {
    const sorted = [...jobs.values()].sort((a, b) => b.id - a.id);
    tbody.replaceChildren(...sorted.map(row));
    if (!sorted.length) tbody.append(h("tr", {}, h("td", { colspan: 8, class: "muted" }, "No jobs yet.")));
  };

  const upsert = (job: Job) => {
    jobs.set(job.id, job);
    const old = tbody.querySelector(`tr[data-job-id="${job.id}"]`);
    if (old) old.replaceWith(row(job));
    else render();
  };

  const load = async () => {
    try {
      const page = await api<Page<Job>>("/api/jobs?limit=100");
      jobs.clear();
      for (const j of page.items) jobs.set(j.id, j);
      render();
    } catch (err) {
      note.textContent = `could not load jobs: ${errorText(err)}`;
    }
  };

  const cancel = async (id: number) => {
    try {
      upsert(await post<Job>(`/api/jobs/${id}/cancel`));
    } catch (err) {
      alert(`Cancel failed: ${errorText(err)}`);
    }
  };

  // live updates; if the stream drops, poll until it is back (EventSource reconnects by itself)
  const events = subscribe("/api/events", { job: upsert }, (state) => {
    if (state === "open") {
      note.textContent = "live";
      if (poll !== null) window.clearInterval(poll);
      poll = null;
      void load(); // catch up on whatever changed while disconnected
    } else if (poll === null) {
      note.textContent = `stream lost, polling every ${POLL_MS / 1000} s`;
      poll = window.setInterval(load, POLL_MS);
    }
  });

  root.append(
    h("section", {}, h("div", { class: "title-row" }, h("h1", {}, "Jobs"), note)),
    h(
      "table",
      { class: "grid", id: "jobs-table" },
      h(
        "thead",
        {},
        h(
          "tr",
          {},
          ...["id", "name", "status", "progress", "loss", "created", "worker", ""].map((c) => h("th", {}, c)),
        ),
      ),
      tbody,
    ),
    submitForm(upsert),
  );
  void load();

  return () => {
    events.close();
    if (poll !== null) window.clearInterval(poll);
  };
}

function submitForm(onSubmitted: (job: Job) => void): HTMLElement {
  const text = h("textarea", { id: "spec-input", rows: 14, spellcheck: "false" }) as HTMLTextAreaElement;
  text.value = JSON.stringify(DEFAULT_SPEC, null, 2);
  const out = h("div", { id: "submit-result", role: "status" });
  const submit = async (ev: Event) => {
    ev.preventDefault();
    out.className = "";
    out.textContent = "";
    let spec: unknown;
    try {
      spec = JSON.parse(text.value);
    } catch (err) {
      out.className = "error";
      out.textContent = `Not valid JSON: ${errorText(err)}`;
      return;
    }
    try {
      const job = await post<Job>("/api/jobs", spec);
      onSubmitted(job);
      out.className = "ok";
      out.replaceChildren("Submitted ", h("a", { href: `#/jobs/${job.id}` }, `job #${job.id}`), ".");
    } catch (err) {
      out.className = "error";
      out.textContent = errorText(err);
    }
  };
  return h(
    "form",
    { class: "card", id: "submit-form", onsubmit: submit },
    h("h2", {}, "Submit job"),
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
}
