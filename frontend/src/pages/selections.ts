// Model-selection batches: the list, and one batch's leaderboard, curves and parallel coordinates.
import {
  api,
  type Curves,
  lookup,
  type Metrics,
  post,
  type Selection,
  type SelectionsPage,
  type SelectionStreamEvents,
  subscribe,
  TERMINAL,
  type Trial,
  type TrialReport,
} from "../api";
import { PALETTE, StepChart } from "../charts";
import { DeviceUseChart } from "../hardware";
import {
  badge,
  errorText,
  fact,
  fmtNum,
  fmtTime,
  gridTable,
  h,
  parsedJson,
  progressBar,
  replace,
} from "../dom";
import { bestSoFar, importance, MIN_OBSERVATIONS } from "../importance";
import { parallelCoordinates } from "../parcoords";
import { compareHref, MAX_COMPARE } from "./compare";

/** A trial's colour, the same on the curves chart and the parallel coordinates. */
/** Leaderboard rows shown before "Show all" (a sort still orders every trial). */
export const BOARD_ROWS = 100;

export const trialColour = (t: Trial): string => PALETTE[t.index % PALETTE.length];

export function selectionsPage(root: HTMLElement): () => void {
  const tbody = h("tbody");
  root.append(
    h(
      "div",
      { class: "title-row" },
      h("h1", {}, "Selections"),
      h("a", { class: "button", id: "new-selection", href: "#/selections/new" }, "New selection"),
    ),
    gridTable(
      { id: "selections-table" },
      ["id", "name", "status", "metric", "scheduler", "trials", "created"],
      tbody,
    ),
  );
  const load = async () => {
    try {
      const page = await api<SelectionsPage>("/api/selections?limit=100");
      tbody.replaceChildren(
        ...page.items
          .sort((a, b) => b.id - a.id)
          .map((s) =>
            h(
              "tr",
              { "data-selection-id": s.id },
              h("td", {}, h("a", { href: `#/selections/${s.id}` }, s.id)),
              h("td", {}, h("a", { href: `#/selections/${s.id}` }, s.name)),
              h("td", {}, badge(s.status)),
              h("td", {}, `${s.metric} (${s.mode})`),
              h("td", {}, s.scheduler),
              h("td", { class: "num" }, s.trials?.length ?? "—"),
              h("td", {}, fmtTime(s.created_at)),
            ),
          ),
      );
      if (!page.items.length)
        tbody.append(h("tr", {}, h("td", { colspan: 7, class: "muted" }, "No selections yet.")));
    } catch (err) {
      tbody.replaceChildren(h("tr", {}, h("td", { colspan: 7, class: "error" }, errorText(err))));
    }
  };
  void load();
  const timer = window.setInterval(load, 5000);
  return () => window.clearInterval(timer);
}

type SortKey = { col: string; dir: 1 | -1 };

export function selectionPage(root: HTMLElement, id: number): () => void {
  const header = h("section", { id: "selection-header" }, "loading…");
  const board = h("table", { class: "grid sortable", id: "leaderboard" });
  const curvesEl = h("div", { class: "chart", id: "curves-chart" });
  const hwEl = h("div", { class: "chart", id: "selection-hw-chart" });
  const hwSection = h("section", { class: "card", id: "selection-hardware" }, hwEl);
  const deviceUse = new DeviceUseChart(hwSection, hwEl);
  const pcEl = h("div", { id: "parcoords" });
  const historyEl = h("div", { class: "chart", id: "best-so-far-chart" });
  const historyNote = h("p", { class: "muted", id: "best-so-far-note" }, "No trial has ended yet.");
  const importanceEl = h("div", { id: "importance" });
  const compareBtn = h(
    "a",
    { class: "button small disabled", id: "compare-trials", href: "#/compare" },
    "Compare",
  );
  const actionsOut = h("div", { id: "selection-result", role: "status" });
  const addText = h("textarea", { id: "add-trials-input", rows: 5, spellcheck: "false" });
  root.append(
    header,
    h(
      "section",
      { class: "card" },
      h("div", { class: "title-row" }, h("h2", {}, "Leaderboard"), compareBtn),
      board,
    ),
    h("section", { class: "card" }, curvesEl),
    h(
      "div",
      { class: "side-by-side" },
      h("section", { class: "card", id: "best-so-far" }, h("h2", {}, "Best so far"), historyEl, historyNote),
      h(
        "section",
        { class: "card", id: "importance-card" },
        h("h2", {}, "Parameter importance"),
        importanceEl,
        h(
          "p",
          { class: "muted legend-note" },
          "The share of the metric's variation (its ranks) each parameter explains on its own, over the trials that trained to the end: fANOVA's main effects with bins in place of a forest (docs/selection.md).",
        ),
      ),
    ),
    hwSection,
    h(
      "section",
      { class: "card" },
      h("h2", {}, "Hyperparameters against the metric"),
      h(
        "p",
        { class: "muted legend-note" },
        "One line per trial, in its colour on the curves chart; thickest: the best trial; dashed: stopped early; grey: no metric yet.",
      ),
      pcEl,
    ),
    h(
      "form",
      { class: "card", id: "add-trials-form", onsubmit: (ev: Event) => void addTrials(ev) },
      h("h2", {}, "Add trials"),
      h(
        "label",
        { for: "add-trials-input", class: "muted" },
        'A JSON list of parameter sets, e.g. [{"train.lr": 0.001}]',
      ),
      addText,
      h("div", { class: "form-row" }, h("button", { type: "submit" }, "Add trials")),
      actionsOut,
    ),
  );

  let sel: Selection | null = null;
  const trials = new Map<number, Trial>();
  let sort: SortKey = { col: "rank", dir: 1 };
  // a batch of 1,000 trials: the table lists the first BOARD_ROWS in its order until asked for
  // all (laying out 1,000 rows took the page most of a second, bench/scale.py)
  let showAll = false;
  let chart: StepChart | null = null;
  let history: StepChart | null = null;
  let stream: EventSource | null = null;
  let closed = false;
  let redrawTimer: number | null = null;
  // trials ticked for the compare view (by trial id; the view shows their jobs)
  const picked = new Set<number>();
  const showPicked = () => {
    const jobs = [...picked].map((tid) => trials.get(tid)?.job_id).filter((j): j is number => j != null);
    compareBtn.textContent = `Compare ${picked.size}/${MAX_COMPARE}`;
    compareBtn.setAttribute("href", compareHref(jobs, { selection: id }));
    compareBtn.classList.toggle("disabled", picked.size === 0);
    for (const box of board.querySelectorAll<HTMLInputElement>("input[data-pick]"))
      box.disabled = !box.checked && picked.size >= MAX_COMPARE;
  };

  const metric = () => sel?.metric ?? "val_loss";
  const lineKey = (t: Trial) => `t${t.id}`;

  // points marked: a trial stopped at its first rung has a single point, which a bare line hides
  const lineOf = (t: Trial) => ({
    key: lineKey(t),
    label: `trial ${t.index}`,
    color: trialColour(t),
    points: true,
  });

  const ensureLine = (t: Trial) => {
    if (!chart || chart.has(lineKey(t))) return false;
    chart.addLine(lineOf(t));
    return true;
  };

  /** Every trial's curve in one request: one per trial was a thousand for a batch of 1,000. */
  const loadCurves = async () => {
    const got = await api<Curves>(`/api/selections/${id}/curves?name=${metric()}&max_points=1000`).catch(
      () => null,
    );
    for (const t of trials.values())
      if (t.job_id !== null) chart?.addSeries(lineKey(t), got?.curves[String(t.job_id)]);
  };

  const loadCurve = async (t: Trial) => {
    if (t.job_id === null || !chart) return;
    const m = await api<Metrics>(`/api/jobs/${t.job_id}/metrics?names=${metric()}&max_points=1000`).catch(
      () => null,
    );
    chart?.addSeries(lineKey(t), m?.series[metric()]);
  };

  const resultOf = (t: Trial): TrialReport | null => t.result ?? null;
  // when an ended trial's job finished (ms; the API's trial carries it): the best-so-far order
  const endOf = (t: Trial): number => (t.finished_at ? Date.parse(t.finished_at) : Infinity);

  const upsertTrial = (t: Trial) => {
    const before = trials.get(t.id);
    // the stream opens with every trial's state, which the page has drawn from the REST answer
    // already: redrawing a batch's 1,000 unchanged rows and lines cost it a second
    if (before && JSON.stringify(before) === JSON.stringify(t)) return;
    trials.set(t.id, t);
    if (ensureLine(t) || (before && before.job_id === null && t.job_id !== null)) void loadCurve(t);
    scheduleRedraw();
  };

  // why a trial ended, in words: for a rung stop, its value against the rung's cut-off
  const whyEnded = (t: Trial): string => {
    const r = resultOf(t);
    const stop = t.stop_reason ?? r?.stop_reason ?? null;
    if (t.status === "stopped_early" && stop) {
      const worse = sel?.mode === "max" ? "≤" : "≥";
      const bracket = sel?.request.early_stopping?.kind === "hyperband" ? `, bracket ${stop.bracket}` : "";
      return `rung ${stop.rung}: ${fmtNum(stop.value)} ${worse} cut-off ${fmtNum(stop.cutoff)} (kept ${stop.kept} of ${stop.of}${bracket})`;
    }
    if (t.status === "stopped_early") return "stopped at a rung";
    if (t.status === "succeeded") return `trained to step ${t.steps_done}`;
    if (t.status === "stopped") return "stopped on request";
    if (t.status === "cancelled") return "batch cancelled";
    if (t.status === "failed") return r?.error ?? "failed";
    return "—";
  };

  // leaderboard order: the server's when it has one, else by best metric
  const ranking = (): Map<number, number> => {
    const ids = sel?.leaderboard?.length ? sel.leaderboard : [];
    const scored = [...trials.values()]
      .filter((t) => t.best_metric !== null && !ids.includes(t.id))
      .sort((a, b) => (a.best_metric! - b.best_metric!) * (sel?.mode === "max" ? -1 : 1));
    return new Map([...ids, ...scored.map((t) => t.id)].map((tid, i) => [tid, i + 1]));
  };

  const paramKeys = () => [
    ...new Set([
      ...Object.keys(sel?.space ?? {}),
      ...[...trials.values()].flatMap((t) => Object.keys(t.params)),
    ]),
  ];

  const renderBoard = () => {
    const rank = ranking();
    const keys = paramKeys();
    const cols: { key: string; label: string; value: (t: Trial) => number | string | null }[] = [
      { key: "rank", label: "#", value: (t) => rank.get(t.id) ?? null },
      { key: "index", label: "trial", value: (t) => t.index },
      { key: "status", label: "status", value: (t) => t.status },
      // a trial without the parameter (one added later with extra keys) runs the base spec's value
      ...keys.map((k) => ({
        key: `p:${k}`,
        label: k,
        value: (t: Trial) => (t.params[k] ?? lookup(sel?.request.base, k) ?? null) as number | string | null,
      })),
      { key: "steps", label: "steps", value: (t) => t.steps_done },
      { key: "last", label: `last ${metric()}`, value: (t) => t.last_metric },
      { key: "best", label: `best ${metric()}`, value: (t) => t.best_metric },
      { key: "compute", label: "compute s", value: (t) => t.compute_s ?? resultOf(t)?.compute_s ?? null },
      { key: "copy", label: "copy s", value: (t) => t.copy_s ?? resultOf(t)?.copy_s ?? null },
      { key: "why", label: "why it ended", value: (t) => whyEnded(t) },
    ];
    const col = cols.find((c) => c.key === sort.col) ?? cols[0];
    const rows = [...trials.values()].sort((a, b) => compare(col.value(a), col.value(b), sort.dir));
    const th = (c: (typeof cols)[number]) =>
      h(
        "th",
        {
          "data-sort": c.key,
          class: c.key === sort.col ? (sort.dir === 1 ? "sorted asc" : "sorted desc") : "",
          onclick: () => {
            sort = { col: c.key, dir: sort.col === c.key ? (-sort.dir as 1 | -1) : 1 };
            renderBoard();
          },
        },
        c.label,
      );
    const foot =
      rows.length > BOARD_ROWS
        ? h(
            "tfoot",
            {},
            h(
              "tr",
              {},
              h(
                "td",
                { colspan: cols.length + 3 },
                h(
                  "button",
                  {
                    class: "small secondary",
                    id: "leaderboard-all",
                    onclick: () => {
                      showAll = !showAll;
                      renderBoard();
                    },
                  },
                  showAll ? `Show the first ${BOARD_ROWS}` : `Show all ${rows.length} trials`,
                ),
              ),
            ),
          )
        : null;
    board.replaceChildren(
      h("thead", {}, h("tr", {}, h("th", {}), ...cols.map(th), h("th", {}, "job"), h("th", {}))),
      h(
        "tbody",
        {},
        ...(showAll ? rows : rows.slice(0, BOARD_ROWS)).map((t) =>
          h(
            "tr",
            { "data-trial-id": t.id, "data-status": t.status, class: t.stopped_early ? "stopped" : "" },
            h(
              "td",
              { class: "pick" },
              h("span", { class: "swatch", style: `background:${trialColour(t)}` }),
              h("input", {
                type: "checkbox",
                "data-pick": t.id,
                "aria-label": `compare trial ${t.index}`,
                checked: picked.has(t.id),
                disabled: t.job_id === null || (!picked.has(t.id) && picked.size >= MAX_COMPARE),
                onchange: (ev: Event) => {
                  if ((ev.target as HTMLInputElement).checked && picked.size < MAX_COMPARE) picked.add(t.id);
                  else picked.delete(t.id);
                  showPicked();
                },
              }),
            ),
            ...cols.map((c) => {
              const v = c.value(t);
              if (c.key === "status") return h("td", {}, badge(t.status));
              if (c.key === "steps") return h("td", {}, progressBar(t.steps_done, t.steps_total));
              return h(
                "td",
                { class: typeof v === "number" ? "num" : "", "data-col": c.key },
                typeof v === "number" ? fmtNum(v) : (v ?? "—"),
              );
            }),
            h("td", {}, t.job_id !== null ? h("a", { href: `#/jobs/${t.job_id}` }, `#${t.job_id}`) : "—"),
            h(
              "td",
              {},
              TERMINAL.has(t.status)
                ? null
                : h(
                    "button",
                    { class: "small danger", "data-stop": t.id, onclick: () => void stopTrial(t.id) },
                    "Stop",
                  ),
            ),
          ),
        ),
      ),
      ...(foot ? [foot] : []),
    );
  };

  const renderHeader = () => {
    if (!sel) return;
    const s = sel;
    replace(
      header,
      h(
        "div",
        { class: "title-row" },
        h("h1", {}, `Selection #${s.id} · ${s.name}`),
        badge(s.status),
        TERMINAL.has(s.status)
          ? null
          : h(
              "button",
              { class: "small danger", id: "cancel-selection", onclick: () => void cancelBatch() },
              "Cancel batch",
            ),
        h(
          "a",
          {
            class: "button secondary",
            id: "selection-clone",
            href: `#/selections/new?from=${s.id}`,
            title: "the new-selection form, filled with this batch's request",
          },
          "Clone / re-run",
        ),
      ),
      h(
        "dl",
        { class: "facts" },
        fact("metric", `${s.metric} (${s.mode})`),
        fact("search", searchText(s)),
        fact("early stopping", stoppingText(s)),
        fact("checkpoints kept", s.request.checkpoints ?? "—"),
        fact("best trial", bestDownload(s, trials)),
        fact("scheduler", s.scheduler),
        fact("trials", trials.size),
        fact("created", fmtTime(s.created_at)),
        fact("finished", fmtTime(s.finished_at)),
      ),
      s.error ? h("p", { class: "error", id: "selection-error" }, s.error) : null,
      h("details", {}, h("summary", {}, "search space"), h("pre", {}, JSON.stringify(s.space, null, 2))),
    );
  };

  // the width the parallel coordinates were last drawn at
  let pcWidth = 0;
  const renderParcoords = () => {
    if (!sel) return;
    // drawn at this width: the observer's first call (and any under 8 px) does not draw it again
    pcWidth = pcEl.clientWidth;
    pcEl.replaceChildren(
      parallelCoordinates({
        trials: [...trials.values()],
        space: sel.space,
        metric: sel.metric,
        mode: sel.mode,
        base: sel.request.base,
        colour: trialColour,
        width: pcEl.clientWidth,
      }),
    );
  };
  // the plot is drawn to its card's width: redraw when that changes
  const pcResize = new ResizeObserver(() => {
    if (Math.abs(pcEl.clientWidth - pcWidth) < 8) return;
    pcWidth = pcEl.clientWidth;
    renderParcoords();
  });
  pcResize.observe(pcEl);

  /** Best metric against the order the trials ended, each trial's own best beside it. */
  const renderHistory = () => {
    if (!sel || !history) return;
    const ended = [...trials.values()]
      .filter((t) => TERMINAL.has(t.status) && t.best_metric !== null)
      .sort((a, b) => endOf(a) - endOf(b) || a.index - b.index);
    const values = ended.map((t) => t.best_metric!);
    const best = bestSoFar(values, sel.mode);
    for (let i = 0; i < ended.length; i++) {
      history.add("trial", i + 1, values[i]);
      history.add("best", i + 1, best[i]);
    }
    const byIndex = ended.some((t) => !t.finished_at);
    historyEl.dataset.order = ended.map((t) => t.index).join(",");
    historyEl.dataset.best = best.join(",");
    if (!ended.length) return;
    const top = best[best.length - 1];
    const at = values.indexOf(top);
    historyNote.textContent =
      `Best ${sel.metric} ${fmtNum(top)}: trial ${ended[at].index}, the ${ordinal(at + 1)} of ` +
      `${ended.length} ended trial${ended.length === 1 ? "" : "s"} to end` +
      (byIndex ? " (trials with no end time on record in index order, not the order they ended)." : ".");
  };

  /** Each parameter's share of the metric's variation, over the trials that trained to the end. */
  const renderImportance = () => {
    if (!sel) return;
    const done = [...trials.values()].filter((t) => t.status === "succeeded" && t.best_metric !== null);
    const keys = paramKeys();
    const obs = done.map((t) => ({
      params: Object.fromEntries(keys.map((k) => [k, t.params[k] ?? lookup(sel?.request.base, k) ?? null])),
      value: t.best_metric!,
    }));
    importanceEl.dataset.trials = String(obs.length);
    if (obs.length < MIN_OBSERVATIONS) {
      importanceEl.replaceChildren(
        h(
          "p",
          { class: "muted", id: "importance-empty" },
          `Needs ${MIN_OBSERVATIONS} trials that trained to the end; ${obs.length} so far.`,
        ),
      );
      return;
    }
    const ranked = importance(obs, keys);
    importanceEl.replaceChildren(
      h(
        "div",
        { class: "importance" },
        ...ranked.flatMap((p) => {
          const bar = h("div", { class: "bar" });
          bar.style.width = `${(100 * p.share).toFixed(1)}%`;
          return [
            h("span", { class: "param", "data-param": p.param }, p.param),
            h(
              "div",
              { title: `explains ${(100 * p.explained).toFixed(1)}% of the variation (${p.groups} groups)` },
              bar,
            ),
            h(
              "span",
              { class: "share", "data-param": p.param, "data-share": p.share.toFixed(4) },
              `${Math.round(100 * p.share)}%`,
            ),
          ];
        }),
      ),
      h(
        "p",
        { class: "muted" },
        ranked.every((p) => p.share === 0)
          ? `Over ${obs.length} trials, no parameter explains more of the metric than chance would.`
          : `Over ${obs.length} trials.`,
      ),
    );
  };

  // trial events come in bursts (every trial at each rung); redraw the tables once per burst
  const scheduleRedraw = () => {
    if (redrawTimer !== null) return;
    redrawTimer = window.setTimeout(() => {
      redrawTimer = null;
      renderHeader();
      renderBoard();
      showPicked();
      renderParcoords();
      renderHistory();
      renderImportance();
    }, 200);
  };

  const refresh = async () => {
    sel = await api<Selection>(`/api/selections/${id}`);
    for (const t of sel.trials ?? []) upsertTrial(t);
    scheduleRedraw();
    if (!TERMINAL.has(sel.status)) openStream();
  };

  const act = async (what: string, fn: () => Promise<unknown>) => {
    actionsOut.className = "";
    actionsOut.textContent = "";
    try {
      await fn();
      actionsOut.className = "ok";
      actionsOut.textContent = `${what}: done`;
      await refresh();
    } catch (err) {
      actionsOut.className = "error";
      actionsOut.textContent = `${what}: ${errorText(err)}`;
    }
  };

  const stopTrial = async (tid: number) => {
    const t = trials.get(tid);
    if (!window.confirm(`Stop trial ${t?.index ?? tid}? It ends where it is and cannot be resumed.`)) return;
    await act(`stop trial ${tid}`, () => post(`/api/selections/${id}/trials/${tid}/stop`));
  };
  const cancelBatch = async () => {
    if (!window.confirm(`Cancel selection #${id}? Every trial still running or queued stops.`)) return;
    await act("cancel batch", () => post(`/api/selections/${id}/cancel`));
  };
  const addTrials = async (ev: Event) => {
    ev.preventDefault();
    const parsed = parsedJson(addText.value, actionsOut);
    if (parsed === null) return;
    const params = parsed.value;
    await act("add trials", () =>
      post(`/api/selections/${id}/trials`, { params: Array.isArray(params) ? params : [params] }),
    );
  };

  const start = async () => {
    try {
      sel = await api<Selection>(`/api/selections/${id}`);
    } catch (err) {
      header.replaceChildren(h("p", { class: "error" }, `Selection ${id}: ${errorText(err)}`));
      return;
    }
    if (closed) return;
    chart = new StepChart(curvesEl, {
      title: `${sel.metric} per trial`,
      yLabel: sel.metric,
      lines: [],
      height: 300,
      controls: true,
    });
    history = new StepChart(historyEl, {
      title: `best ${sel.metric} (${sel.mode}) as trials end`,
      yLabel: sel.metric,
      xLabel: "trials ended",
      lines: [
        { key: "best", label: "best so far", color: "#2457a6", width: 2, stepped: true },
        { key: "trial", label: "the trial's best", color: "#7f7f7f", points: true, noLine: true },
      ],
      height: 260,
    });
    history.setEmpty("No trial has ended with a metric yet.");
    const first = sel.trials?.[0];
    addText.value = JSON.stringify(first ? [first.params] : [{}], null, 1);
    // the lines in one go (a redraw per line added was quadratic) and their curves in one request
    chart.addLines((sel.trials ?? []).map(lineOf));
    const curves = loadCurves();
    for (const t of sel.trials ?? []) upsertTrial(t);
    // every trial's curve drawn: what a test, or bench/scale.py, waits for
    void curves.then(() => {
      chart?.drawNow();
      curvesEl.dataset.curvesLoaded = "1";
    });
    chart.setEmpty(
      sel.trials?.length ? `No ${sel.metric} yet: the first evaluation has not happened.` : "No trials yet.",
    );
    openStream();
  };

  // The server ends the stream once the batch is over; EventSource would reconnect every few
  // seconds, so close it then and open it again when added trials make the batch run again.
  let reconnected = false;
  const openStream = () => {
    if (closed || (stream && stream.readyState !== EventSource.CLOSED)) return;
    stream = subscribe<SelectionStreamEvents>(
      `/api/selections/${id}/stream`,
      {
        metric: (m) => {
          if (m.name === metric()) chart?.add(`t${m.trial_id}`, m.step, m.value);
          else deviceUse.add(m.name, m.time, m.value);
        },
        trial: (t) => upsertTrial(t),
        status: (s) => {
          if (!sel) return;
          sel.status = s.status;
          if (TERMINAL.has(s.status)) {
            stream?.close();
            void refresh();
          }
          scheduleRedraw();
        },
      },
      (state) => {
        // points sent while we were disconnected are only in the database: reload the curves
        if (state === "open" && reconnected) void loadCurves();
        if (state === "error") reconnected = true;
      },
    );
  };
  void start();

  return () => {
    closed = true;
    stream?.close();
    pcResize.disconnect();
    chart?.destroy();
    history?.destroy();
    deviceUse.destroy();
    if (redrawTimer !== null) window.clearTimeout(redrawTimer);
  };
}

function searchText(s: Selection): string {
  const r = s.request;
  if (!r.method) return "—";
  const seed = r.seed !== undefined ? `, seed ${r.seed}` : "";
  if (r.method === "grid") return "grid";
  if (r.method === "random") return `random, ${r.trials} trials${seed}`;
  return `${r.method}, ${r.trials} trials in generations of ${r.parallel ?? "one per device"}${seed}`;
}

function stoppingText(s: Selection): string {
  const es = s.request.early_stopping;
  if (!es) return "none";
  return `${es.kind}, reduction factor ${es.reduction_factor}, first rung at step ${es.min_steps}`;
}

function compare(a: number | string | null, b: number | string | null, dir: 1 | -1): number {
  if (a === null) return b === null ? 0 : 1; // missing values sink to the bottom either way
  if (b === null) return -1;
  if (typeof a === "number" && typeof b === "number") return (a - b) * dir;
  return String(a).localeCompare(String(b)) * dir;
}

/** The batch's best trial's weights in one click (GET /api/selections/{id}/checkpoint serves the
 * leaderboard's first trial's checkpoint), once the batch has ended and kept checkpoints. */
function bestDownload(s: Selection, trials: Map<number, Trial>): HTMLElement | string {
  const best = s.leaderboard?.length ? trials.get(s.leaderboard[0]) : undefined;
  if (!best) return "—";
  const which = `trial ${best.index}`;
  if (s.request.checkpoints === "none" || !TERMINAL.has(s.status)) return which;
  return h(
    "span",
    {},
    h(
      "a",
      {
        id: "selection-download-best",
        href: `/api/selections/${s.id}/checkpoint?format=safetensors`,
        download: "",
        title: `${which}'s model weights as safetensors`,
      },
      `${which}: weights (safetensors)`,
    ),
    " · ",
    h(
      "a",
      { id: "selection-download-best-pt", href: `/api/selections/${s.id}/checkpoint`, download: "" },
      "checkpoint",
    ),
  );
}

function ordinal(n: number): string {
  const tens = n % 100;
  const suffix =
    tens >= 11 && tens <= 13
      ? "th"
      : (({ 1: "st", 2: "nd", 3: "rd" } as Record<number, string>)[n % 10] ?? "th");
  return `${n}${suffix}`;
}
