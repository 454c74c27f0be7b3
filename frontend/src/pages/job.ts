// One job: header (with its pace: steps/s, elapsed, ETA), live loss, throughput and hardware
// charts, the log panel (logs.ts), and the pipeline Gantt chart.
import {
  api,
  ApiError,
  type CheckpointInfo,
  type Job,
  type JobStreamEvents,
  type JobsStreamEvents,
  type LogLine,
  type LogPage,
  type Metrics,
  post,
  subscribe,
  TERMINAL,
  type Timeline,
  trialReportOf,
} from "../api";
import { StepChart } from "../charts";
import { badge, clock, divergedBadge, errorText, fact, fmtNum, fmtTime, h, replace } from "../dom";
import { gantt, ganttLegend } from "../gantt";
import { HardwareCharts } from "../hardware";
import { LogPanel } from "../logs";
import { UserMetricCharts } from "../usermetrics";
import { jobLoss } from "./jobs";

export function jobPage(root: HTMLElement, id: number): () => void {
  const header = h("section", { id: "job-header" }, "loading…");
  const lossEl = h("div", { class: "chart", id: "loss-chart" });
  const tputEl = h("div", { class: "chart", id: "tput-chart" });
  const useEl = h("div", { class: "chart", id: "hw-use-chart" });
  const memEl = h("div", { class: "chart", id: "hw-mem-chart" });
  const hwSection = h(
    "div",
    { class: "charts", id: "hardware" },
    h("div", { class: "card" }, useEl),
    h("div", { class: "card" }, memEl),
  );
  const logPanel = new LogPanel();
  const traceback = h("section", { class: "card", id: "job-traceback-card", hidden: true });
  const pipeline = h("section", { id: "pipeline", hidden: true });
  // the job's own metrics (trainer/report.py), a chart each
  const userSection = h("div", { class: "charts", id: "user-metrics", hidden: true });
  root.append(
    header,
    traceback,
    h("div", { class: "charts" }, h("div", { class: "card" }, lossEl), h("div", { class: "card" }, tputEl)),
    userSection,
    hwSection,
    pipeline,
    logPanel.el,
  );

  const lossChart = new StepChart(lossEl, {
    title: "loss",
    yLabel: "loss",
    lines: [
      { key: "loss", label: "loss", color: "#1f77b4" },
      { key: "val_loss", label: "val_loss", color: "#d62728", width: 2, points: true },
    ],
    controls: true,
  });
  const tputChart = new StepChart(tputEl, {
    title: "throughput",
    yLabel: "tokens/s",
    lines: [{ key: "tokens_per_s", label: "tokens/s", color: "#2ca02c" }],
    controls: true,
  });

  const hw = new HardwareCharts(hwSection, useEl, memEl);
  const userCharts = new UserMetricCharts(userSection);
  let job: Job | null = null;
  /** The newest whole checkpoint (GET .../checkpoint/info), or why there is none. */
  let weights: CheckpointInfo | string | null = null;
  /** The same checkpoint's model weights as safetensors, or why they cannot be sent. */
  let safetensors: CheckpointInfo | string | null = null;
  // the pace: the first and latest loss step this page saw, with when (this browser's clock)
  let firstSeen: { step: number; at: number } | null = null;
  let lastSeen: { step: number; at: number } | null = null;
  let fetchedAt = Date.now();
  let stream: EventSource | null = null;
  let deleted = false;
  let closed = false;
  const addLog = (line: LogLine) => {
    logPanel.add(line);
    showTraceback();
  };
  const addStatus = (s: JobStreamEvents["status"]) => {
    logPanel.addStatus(s);
    showTraceback();
  };

  /** A failed job's last traceback, on top of the page. */
  const showTraceback = () => {
    if (job?.status !== "failed") return;
    const tb = logPanel.traceback();
    if (!tb) return;
    traceback.hidden = false;
    traceback.replaceChildren(
      h("h2", {}, "Traceback"),
      h("pre", { class: "error", id: "job-traceback" }, tb),
    );
  };

  /** steps/s, elapsed and ETA from what the page knows now. */
  const pace = (): string => {
    if (!job || job.status === "queued") return "—";
    const running = job.status === "running";
    const elapsed = (job.run_seconds ?? 0) + (running ? (Date.now() - fetchedAt) / 1000 : 0);
    const steps = job.progress?.steps ?? 0;
    const step = job.progress?.step ?? 0;
    let rate: number | null = null;
    if (running && firstSeen && lastSeen && lastSeen.step > firstSeen.step)
      rate = ((lastSeen.step - firstSeen.step) * 1000) / (lastSeen.at - firstSeen.at);
    else if (elapsed > 0 && step > 0) rate = step / elapsed;
    const eta = running && rate ? (steps - step) / rate : null;
    return (
      `${rate ? rate.toFixed(2) : "—"} steps/s · elapsed ${clock(elapsed)}` +
      (running ? ` · ETA ${eta === null ? "—" : clock(eta)}` : "")
    );
  };
  const paceTimer = window.setInterval(() => {
    const el = header.querySelector("#job-pace");
    if (el) el.textContent = pace();
  }, 1000);

  const renderHeader = () => {
    if (!job) return;
    const j = job;
    const active = !TERMINAL.has(j.status) && !deleted;
    // a trial's job: its result is the trial's report (status, stop_reason)
    const trial = trialReportOf(j);
    const stop = trial?.stop_reason ?? j.stop_reason ?? null;
    replace(
      header,
      deleted
        ? h(
            "p",
            { class: "error", id: "job-deleted" },
            "This job was deleted: its metrics, logs and checkpoints are gone. What is shown is what this page had loaded.",
          )
        : null,
      h(
        "div",
        { class: "title-row" },
        h("h1", {}, `Job #${j.id} · ${j.name}`),
        // a trial's job ends "succeeded" even when the rungs stopped it early
        deleted
          ? badge("deleted")
          : trial?.status === "stopped_early" || j.stopped_early
            ? badge("stopped_early")
            : badge(j.status),
        divergedBadge(j),
        active && !j.cancel_requested
          ? h("button", { class: "small danger", onclick: () => void cancel() }, "Cancel")
          : null,
        j.cancel_requested && active ? h("span", { class: "muted" }, "cancelling…") : null,
        // the submit form filled with this job's spec, or a selection batch with it as the base
        h(
          "a",
          {
            class: "button secondary",
            id: "job-clone",
            href: `#/?clone=${j.id}`,
            title: "the submit form, filled with this job's spec",
          },
          "Clone / re-run",
        ),
        h(
          "a",
          {
            class: "button secondary",
            id: "job-to-selection",
            href: `#/selections/new?job=${j.id}`,
            title: "a new selection batch with this job's spec as its base",
          },
          "Search around it",
        ),
      ),
      h(
        "dl",
        { class: "facts" },
        j.selection_id
          ? fact(
              "selection",
              h(
                "a",
                { id: "job-selection", href: `#/selections/${j.selection_id}` },
                `batch #${j.selection_id}`,
              ),
            )
          : null,
        fact("owner", j.owner ?? "—"),
        fact("worker", j.worker ?? "—"),
        j.status === "queued"
          ? fact(
              "queue",
              h("span", { id: "job-queue-position" }, j.queue_position ? `#${j.queue_position}` : "—"),
            )
          : null,
        // a running job waits too while the worker prepares its environment (its requirements)
        (j.status === "queued" || j.status === "running") && j.wait_reason
          ? fact("waiting", h("span", { id: "job-wait-reason" }, j.wait_reason))
          : null,
        (j.reservation ?? []).length
          ? fact(
              "reservation",
              h(
                "span",
                { id: "job-reservation" },
                (j.reservation ?? [])
                  .map(
                    (r) =>
                      `node ${r.node_rank}/${r.nnodes}: ${r.worker}, ${r.slots} slot(s)` +
                      (r.gpus ? `, ${r.gpus} GPU(s)` : "") +
                      (r.claimed ? "" : " (starting)"),
                  )
                  .join("; "),
              ),
            )
          : null,
        fact("attempts", j.attempts),
        fact(
          "progress",
          h("span", { id: "job-progress" }, j.progress ? `${j.progress.step}/${j.progress.steps}` : "—"),
        ),
        fact("pace", h("span", { id: "job-pace" }, pace())),
        fact("loss", h("span", { id: "job-loss" }, fmtNum(jobLoss(j)))),
        // the newest whole checkpoint to download, or why there is none
        weights === null
          ? null
          : fact(
              "weights",
              typeof weights === "string"
                ? h("span", { class: "muted", id: "job-no-download" }, weights)
                : h(
                    "span",
                    {},
                    h(
                      "a",
                      {
                        id: "job-download",
                        href: `/api/jobs/${j.id}/checkpoint`,
                        download: weights.filename,
                      },
                      `download checkpoint (step ${weights.step}, ${mib(weights.size)})`,
                    ),
                    h("br"),
                    safetensors === null
                      ? null
                      : typeof safetensors === "string"
                        ? h("span", { class: "muted", id: "job-no-safetensors" }, safetensors)
                        : h(
                            "a",
                            {
                              id: "job-download-safetensors",
                              href: `/api/jobs/${j.id}/checkpoint?format=safetensors`,
                              download: safetensors.filename,
                            },
                            `download weights (safetensors, ${mib(safetensors.size)})`,
                          ),
                  ),
            ),
        fact("created", fmtTime(j.created_at)),
        fact("started", fmtTime(j.started_at)),
        fact("finished", fmtTime(j.finished_at)),
      ),
      j.diverged
        ? h(
            "p",
            { class: "error", id: "job-divergence" },
            // the worker's sentence, with the numbers (jobrules/divergence.py)
            j.divergence ?? "diverged: the training loss ended far above where it began",
          )
        : null,
      stop
        ? h(
            "p",
            { id: "job-stopped-early" },
            `Trial stopped early at rung ${stop.rung} of batch #${j.selection_id}: its ${fmtNum(stop.value)} ` +
              `against the rung's cut-off ${fmtNum(stop.cutoff)} (${stop.kept} of ${stop.of} went on).`,
          )
        : null,
      j.error ? h("pre", { class: "error", id: "job-error" }, j.error) : null,
      j.result
        ? h(
            "details",
            { open: true },
            h("summary", {}, "result"),
            h("pre", { id: "job-result" }, JSON.stringify(j.result, null, 2)),
          )
        : null,
      h("details", {}, h("summary", {}, "spec"), h("pre", {}, JSON.stringify(j.spec, null, 2))),
    );
  };

  /** Why a chart has no points yet, from the job's state. */
  const explainEmpty = () => {
    const why = (what: string) => {
      const st = job?.status;
      if (st === "queued") return `No ${what} yet: the job is queued.`;
      if (st === "running") return `No ${what} yet: waiting for the first step.`;
      if (st === "failed") return `No ${what} recorded: the job failed before its first step.`;
      if (st === "cancelled") return `No ${what} recorded: the job was cancelled before its first step.`;
      return `This job recorded no ${what}.`;
    };
    lossChart.setEmpty(why("loss"));
    tputChart.setEmpty(why("throughput"));
  };

  const refreshJob = async () => {
    job = await api<Job>(`/api/jobs/${id}`);
    fetchedAt = Date.now();
    renderHeader();
    showTraceback();
    void loadWeights();
  };

  /** What the download link offers: asked when the page loads and again when the job ends. */
  const loadWeights = async () => {
    if (!job || job.status === "queued" || deleted) return;
    try {
      weights = await api<CheckpointInfo>(`/api/jobs/${id}/checkpoint/info`);
    } catch (err) {
      weights = err instanceof ApiError && err.status === 404 ? err.message : null;
    }
    if (weights !== null && typeof weights !== "string") {
      try {
        safetensors = await api<CheckpointInfo>(`/api/jobs/${id}/checkpoint/info?format=safetensors`);
      } catch (err) {
        // 4xx: a checkpoint safetensors cannot carry, with the reason
        safetensors = err instanceof ApiError && err.status < 500 ? `no safetensors: ${err.message}` : null;
      }
    }
    if (!closed) renderHeader();
  };

  /** The job is gone: keep what the page shows, marked deleted, and stop its stream. */
  const markDeleted = () => {
    deleted = true;
    stream?.close();
    renderHeader();
  };

  /** Refetch after a change; a job deleted meanwhile (404) shows as deleted. */
  const refetch = async () => {
    try {
      await refreshJob();
    } catch (err) {
      if (err instanceof ApiError && err.status === 404 && job) markDeleted();
    }
  };

  const cancel = async () => {
    if (!window.confirm(`Cancel job #${id}? Its training stops and cannot be resumed.`)) return;
    try {
      job = await post<Job>(`/api/jobs/${id}/cancel`);
      renderHeader();
    } catch (err) {
      alert(`Cancel failed: ${errorText(err)}`);
    }
  };

  const loadTimeline = async () => {
    const p = job?.spec.parallel?.pipeline;
    if (!p) return;
    pipeline.hidden = false;
    pipeline.className = "card";
    const title = h(
      "h2",
      {},
      `Pipeline: ${p.schedule}, ${p.stages} stages × ${p.microbatches} micro-batches`,
    );
    try {
      const tl = await api<Timeline>(`/api/jobs/${id}/timeline`);
      pipeline.replaceChildren(title, timelineView(tl));
    } catch (err) {
      const msg =
        err instanceof ApiError && err.status === 404
          ? "No timeline recorded yet; it appears once the job has run a step."
          : `Could not load the timeline: ${errorText(err)}`;
      pipeline.replaceChildren(title, h("p", { class: "muted", id: "timeline-missing" }, msg));
    }
  };

  const start = async () => {
    try {
      await refreshJob();
    } catch (err) {
      header.replaceChildren(h("p", { class: "error" }, `Job ${id}: ${errorText(err)}`));
      return;
    }
    void loadTimeline();
    const [metrics, logPage] = await Promise.all([
      // every series: the job's own metrics have names only the job knows
      api<Metrics>(`/api/jobs/${id}/metrics?max_points=1000`).catch(() => null),
      api<LogPage>(`/api/jobs/${id}/logs?limit=10000`).catch(() => null),
    ]);
    if (closed) return;
    for (const name of ["loss", "val_loss"]) lossChart.addSeries(name, metrics?.series[name]);
    tputChart.addSeries("tokens_per_s", metrics?.series.tokens_per_s);
    if (metrics) explainEmpty();
    else {
      lossChart.setEmpty("Could not load the metrics.");
      tputChart.setEmpty("Could not load the metrics.");
    }
    for (const [name, series] of Object.entries(metrics?.series ?? {}).sort(([a], [b]) =>
      a.localeCompare(b),
    )) {
      if (!userCharts.addSeries(name, series)) hw.addSeries(name, series);
    }
    for (const line of logPage?.items ?? []) addLog(line);

    stream = subscribe<JobStreamEvents>(`/api/jobs/${id}/stream`, {
      metric: (m) => {
        if (hw.add(m.name, m.step, m.value)) return;
        if (userCharts.add(m.name, m.step, m.value)) return;
        if (m.name === "tokens_per_s") tputChart.add(m.name, m.step, m.value);
        else lossChart.add(m.name, m.step, m.value);
        // keep the header's progress and loss current without re-rendering it (that would fold
        // the open <details>)
        if (m.name === "loss" && job && m.step >= (job.progress?.step ?? 0)) {
          job.progress = { step: m.step, steps: job.progress?.steps ?? m.step, loss: m.value };
          lastSeen = { step: m.step, at: Date.now() };
          firstSeen = firstSeen ?? lastSeen;
          header.querySelector("#job-progress")!.textContent = `${m.step}/${job.progress.steps}`;
          header.querySelector("#job-loss")!.textContent = fmtNum(m.value);
        }
      },
      status: (s) => {
        addStatus(s);
        if (!job) return;
        job.status = s.status;
        job.error = s.error ?? job.error;
        renderHeader();
        explainEmpty();
        // finished: fetch the result and timestamps, and the timeline the worker stored at the end
        if (TERMINAL.has(s.status)) {
          void refetch().then(loadTimeline);
          stream?.close();
        }
      },
      log: (l) => addLog(l),
    });
    // a finished job's stream may end; stop EventSource reconnecting to it forever
    stream.addEventListener("error", () => {
      if (job && TERMINAL.has(job.status)) stream?.close();
    });
  };
  void start();

  // the jobs-wide stream tells this page when the job is deleted, and asks for a refetch when
  // the server lost changes (`resync`: its broker restarted)
  const changes = subscribe<JobsStreamEvents>("/api/events", {
    deleted: (d) => {
      if (d.job_id === id) markDeleted();
    },
    resync: () => {
      if (!deleted && job) void refetch();
    },
  });

  return () => {
    closed = true;
    changes.close();
    stream?.close();
    lossChart.destroy();
    tputChart.destroy();
    hw.destroy();
    userCharts.destroy();
    window.clearInterval(paceTimer);
  };
}

function timelineView(tl: Timeline): HTMLElement {
  const ranks = Math.max(
    tl.stages,
    ...tl.executed.map((a) => a.rank + 1),
    ...tl.simulated.map((a) => a.rank + 1),
  );
  const panel = (
    title: string,
    id: string,
    acts: Timeline["executed"],
    bubble: number | null,
    unit: "s" | "cost",
  ) =>
    h(
      "figure",
      { class: "gantt-panel", id },
      h("figcaption", {}, `${title} · bubble ${bubble === null ? "—" : `${(100 * bubble).toFixed(1)}%`}`),
      acts.length ? gantt(acts, { ranks, unit, label: title }) : h("p", { class: "muted" }, "none recorded"),
    );
  return h(
    "div",
    {},
    ganttLegend(),
    h(
      "div",
      { class: "gantt-pair" },
      panel("executed", "gantt-executed", tl.executed, tl.bubble_executed, "s"),
      // the simulator runs on the per-op costs measured in this job, so its clock is seconds too
      panel("simulated", "gantt-simulated", tl.simulated, tl.bubble_simulated, "s"),
    ),
  );
}

function mib(bytes: number): string {
  return `${(bytes / 2 ** 20).toFixed(1)} MiB`;
}
