// The "new selection" form (#/selections/new): a batch's base spec, its search space one dimension a
// row, the method, early stopping, trials and parallelism, the metric and its mode. It starts from an
// example, from a batch's request (?from=ID: clone / re-run) or from a job's spec as the base
// (?job=ID), submits through POST /api/selections, and puts each refusal next to the field it names.
import {
  api,
  ApiError,
  type FieldProblem,
  type Job,
  post,
  type Selection,
  type SelectionRequest,
} from "../api";
import { errorText, gridTable, h } from "../dom";
import { specTools } from "../workspace";
import { DEFAULT_SPEC } from "./jobs";

type Body = Record<string, unknown>;

// typed by the API's own enums (generated/api-schema.ts): a value the API drops fails the type check
type Req = SelectionRequest;
const METHODS: Record<Req["method"], string> = {
  grid: "every point of the space (lists as they are, ranges need num)",
  random: "independent draws of the space (trials of them), seeded",
  tpe: "Optuna's TPE: `parallel` trials in flight, a new one asked as each ends",
  cmaes: "Optuna's CMA-ES over the numeric ranges",
  qmc: "Optuna's quasi-Monte Carlo (Sobol) over the numeric ranges",
};
const SAMPLERS = new Set(["tpe", "cmaes", "qmc"]);
const STOPPING: NonNullable<Req["early_stopping"]>["kind"][] = ["asha", "sha", "hyperband"];
const SCHEDULERS: Req["scheduler"][] = ["shard-lrtf", "fifo", "round-robin", "sequential"];
const CHECKPOINTS: Req["checkpoints"][] = ["best", "all", "none"];
/** JobSpec paths people search most; any dotted JobSpec path is allowed. */
const COMMON_PATHS = [
  "train.lr",
  "train.batch_size",
  "train.weight_decay",
  "train.optimizer",
  "train.grad_clip",
  "train.seed",
  "model.layers",
  "model.d_model",
  "model.heads",
];
/** The request fields this form edits; any other field of a cloned request is sent on unchanged. */
const FORM_FIELDS = [
  "name",
  "base",
  "space",
  "method",
  "trials",
  "parallel",
  "startup_trials",
  "devices",
  "group_size",
  "seed",
  "early_stopping",
  "metric",
  "mode",
  "scheduler",
  "checkpoints",
  "fuse",
];

const BASE = { ...DEFAULT_SPEC, train: { ...DEFAULT_SPEC.train, steps: 60, eval_every: 10 } };

/** Example requests: the form starts from the first. */
export const SELECTION_EXAMPLES: Record<string, Body> = {
  "learning rate, random search with ASHA": {
    name: "lr-asha",
    base: BASE,
    space: { "train.lr": { low: 1e-4, high: 1e-2, log: true } },
    method: "random",
    trials: 8,
    devices: 2,
    early_stopping: { kind: "asha", reduction_factor: 3, min_steps: 10 },
    metric: "val_loss",
    mode: "min",
  },
  "grid: learning rate × layers": {
    name: "lr-layers-grid",
    base: BASE,
    space: { "train.lr": [0.001, 0.003], "model.layers": [2, 4] },
    method: "grid",
    devices: 2,
    metric: "val_loss",
    mode: "min",
  },
  "TPE over learning rate and width": {
    name: "lr-width-tpe",
    base: BASE,
    space: { "train.lr": { low: 1e-4, high: 3e-2, log: true }, "model.d_model": [32, 64, 128] },
    method: "tpe",
    trials: 16,
    parallel: 2,
    startup_trials: 4,
    devices: 2,
    metric: "val_loss",
    mode: "min",
  },
};

function parseQuery(): URLSearchParams {
  const hash = window.location.hash;
  const i = hash.indexOf("?");
  return new URLSearchParams(i >= 0 ? hash.slice(i + 1) : "");
}

/** One value typed in a choices list: a number, true/false/null or JSON, else the text itself. */
function parseChoice(raw: string): unknown {
  const s = raw.trim();
  try {
    return JSON.parse(s);
  } catch {
    return s;
  }
}

/** A form number: empty -> undefined (the API's default), else the number (or the text, for the API
 * to refuse by name). */
function numberOf(input: HTMLInputElement): number | string | undefined {
  const s = input.value.trim();
  if (!s) return undefined;
  const n = Number(s);
  return Number.isFinite(n) ? n : s;
}

/** One dimension of the space: a range (low, high, log, int, num) or a list of choices. */
class SpaceRow {
  readonly el: HTMLTableRowElement;
  readonly path: HTMLInputElement;
  private readonly kind: HTMLSelectElement;
  private readonly low: HTMLInputElement;
  private readonly high: HTMLInputElement;
  private readonly log: HTMLInputElement;
  private readonly int: HTMLInputElement;
  private readonly num: HTMLInputElement;
  private readonly choices: HTMLInputElement;
  readonly error: HTMLElement;

  constructor(path: string, dim: unknown, onChange: () => void, onRemove: (row: SpaceRow) => void) {
    const input = (attrs: Record<string, string | number>) =>
      h("input", { ...attrs, oninput: onChange, onchange: onChange }) as HTMLInputElement;
    this.path = input({ class: "space-path", list: "space-paths", placeholder: "train.lr", size: 18 });
    this.path.value = path;
    this.kind = h(
      "select",
      { class: "space-kind", onchange: () => (this.show(), onChange()) },
      h("option", { value: "range" }, "range"),
      h("option", { value: "choices" }, "choices"),
    ) as HTMLSelectElement;
    this.low = input({ class: "space-low", placeholder: "low", size: 8, inputmode: "decimal" });
    this.high = input({ class: "space-high", placeholder: "high", size: 8, inputmode: "decimal" });
    this.log = input({ type: "checkbox", class: "space-log" });
    this.int = input({ type: "checkbox", class: "space-int" });
    this.num = input({ class: "space-num", placeholder: "grid points", size: 8, inputmode: "numeric" });
    this.choices = input({ class: "space-choices", placeholder: "0.001, 0.003, adamw", size: 30 });
    this.error = h("div", { class: "field-error", hidden: true });
    this.fill(dim);
    this.el = h(
      "tr",
      { class: "space-row" },
      h("td", {}, this.path),
      h("td", {}, this.kind),
      h(
        "td",
        { class: "space-values" },
        h(
          "span",
          { class: "range-fields" },
          this.low,
          " to ",
          this.high,
          " ",
          h("label", {}, this.log, " log"),
          " ",
          h("label", {}, this.int, " int"),
          " ",
          this.num,
        ),
        h("span", { class: "choice-fields" }, this.choices),
        this.error,
      ),
      h(
        "td",
        {},
        h(
          "button",
          {
            type: "button",
            class: "small secondary",
            title: "remove this dimension",
            onclick: () => onRemove(this),
          },
          "×",
        ),
      ),
    );
    this.show();
  }

  private fill(dim: unknown): void {
    if (Array.isArray(dim)) {
      this.kind.value = "choices";
      this.choices.value = dim.map((v) => (typeof v === "string" ? v : JSON.stringify(v))).join(", ");
      return;
    }
    const r = (dim ?? {}) as Record<string, unknown>;
    this.kind.value = "range";
    this.low.value = r.low === undefined ? "" : String(r.low);
    this.high.value = r.high === undefined ? "" : String(r.high);
    this.log.checked = Boolean(r.log);
    this.int.checked = Boolean(r.int);
    this.num.value = r.num === undefined || r.num === null ? "" : String(r.num);
  }

  private show(): void {
    const range = this.kind.value === "range";
    (this.el?.querySelector(".range-fields") as HTMLElement | null)?.toggleAttribute("hidden", !range);
    (this.el?.querySelector(".choice-fields") as HTMLElement | null)?.toggleAttribute("hidden", range);
  }

  value(): unknown {
    if (this.kind.value === "choices")
      return this.choices.value.trim() ? this.choices.value.split(",").map(parseChoice) : [];
    const out: Body = { low: numberOf(this.low), high: numberOf(this.high) };
    if (this.log.checked) out.log = true;
    if (this.int.checked) out.int = true;
    const num = numberOf(this.num);
    if (num !== undefined) out.num = num;
    return out;
  }
}

export function newSelectionPage(root: HTMLElement): () => void {
  const q = parseQuery();
  let closed = false;
  let extra: Body = {}; // a cloned request's fields this form does not edit
  const errors = new Map<string, HTMLElement>();
  const slot = (key: string) => {
    const el = h("div", { class: "field-error", "data-error-for": key, hidden: true });
    errors.set(key, el);
    return el;
  };
  const field = (key: string, label: string, control: HTMLElement, hint?: string) =>
    h(
      "div",
      { class: "field", "data-field": key },
      h("label", { for: control.id }, label),
      control,
      hint ? h("div", { class: "muted hint" }, hint) : null,
      slot(key),
    );
  const text = (id: string, attrs: Record<string, string | number> = {}) =>
    h("input", { id, ...attrs, oninput: () => preview() }) as HTMLInputElement;
  const select = (id: string, options: string[], labels: Record<string, string> = {}) =>
    h(
      "select",
      { id, onchange: () => (showFor(), preview()) },
      ...options.map((o) => h("option", { value: o }, labels[o] ?? o)),
    ) as HTMLSelectElement;

  const title = h("h1", {}, "New selection batch");
  const origin = h("p", { class: "muted", id: "sel-form-origin" });
  const example = h(
    "select",
    { id: "sel-example" },
    h("option", { value: "" }, "start from an example…"),
    ...Object.keys(SELECTION_EXAMPLES).map((k) => h("option", { value: k }, k)),
  ) as HTMLSelectElement;
  example.onchange = () => {
    if (!example.value) return;
    fill(SELECTION_EXAMPLES[example.value]);
    origin.textContent = `From the example "${example.value}".`;
  };
  const name = text("sel-name", { size: 28 });
  const base = h("textarea", { id: "sel-base", rows: 12, spellcheck: "false" }) as HTMLTextAreaElement;
  base.oninput = () => preview();
  const spaceBody = h("tbody");
  const rows: SpaceRow[] = [];
  const addRow = (path = "", dim: unknown = { low: "", high: "" }) => {
    const row = new SpaceRow(
      path,
      dim,
      () => preview(),
      (r) => {
        rows.splice(rows.indexOf(r), 1);
        r.el.remove();
        preview();
      },
    );
    rows.push(row);
    spaceBody.append(row.el);
  };
  const method = select("sel-method", Object.keys(METHODS));
  const methodHint = h("div", { class: "muted hint", id: "sel-method-hint" });
  const trials = text("sel-trials", { type: "number", min: 1, size: 6 });
  const parallel = text("sel-parallel", { type: "number", min: 1, size: 6 });
  const startup = text("sel-startup", { type: "number", min: 1, size: 6 });
  const devices = text("sel-devices", { type: "number", min: 1, size: 6 });
  const groupSize = text("sel-group-size", { type: "number", min: 1, size: 6 });
  const seed = text("sel-seed", { type: "number", min: 0, size: 8 });
  const stopping = select("sel-stopping", ["", ...STOPPING], { "": "none" });
  const rf = text("sel-rf", { type: "number", min: 2, size: 6 });
  const minSteps = text("sel-min-steps", { type: "number", min: 1, size: 8 });
  const metric = text("sel-metric", { list: "sel-metrics", size: 16 });
  const mode = select("sel-mode", ["min", "max"], {
    min: "min (lower is better)",
    max: "max (higher is better)",
  });
  const scheduler = select("sel-scheduler", SCHEDULERS);
  const checkpoints = select("sel-checkpoints", CHECKPOINTS);
  const fuse = h("input", {
    id: "sel-fuse",
    type: "checkbox",
    onchange: () => preview(),
  }) as HTMLInputElement;
  const previewEl = h("pre", { id: "sel-preview" });
  const out = h("div", { id: "sel-submit-result", role: "status" });

  /** Show the fields the chosen method and stopping take. */
  const showFor = () => {
    const m = method.value;
    methodHint.textContent = METHODS[m as Req["method"]] ?? "";
    const hide = (el: HTMLElement, off: boolean) =>
      (el.closest(".field") as HTMLElement | null)?.toggleAttribute("hidden", off);
    hide(trials, m === "grid");
    hide(parallel, !SAMPLERS.has(m));
    hide(startup, m !== "tpe" && m !== "cmaes");
    hide(rf, !stopping.value);
    hide(minSteps, !stopping.value);
  };

  /** The request as the form says it now; a base that is not JSON is sent as its text (and refused
   * by name). */
  const body = (): Body => {
    let baseSpec: unknown;
    try {
      baseSpec = JSON.parse(base.value);
    } catch {
      baseSpec = base.value;
    }
    const space: Body = {};
    for (const r of rows) if (r.path.value.trim()) space[r.path.value.trim()] = r.value();
    const m = method.value;
    const b: Body = {
      ...extra,
      name: name.value.trim() || undefined,
      base: baseSpec,
      space,
      method: m,
      trials: m === "grid" ? undefined : numberOf(trials),
      parallel: SAMPLERS.has(m) ? numberOf(parallel) : undefined,
      startup_trials: m === "tpe" || m === "cmaes" ? numberOf(startup) : undefined,
      devices: numberOf(devices),
      group_size: numberOf(groupSize),
      seed: numberOf(seed),
      early_stopping: stopping.value
        ? { kind: stopping.value, reduction_factor: numberOf(rf), min_steps: numberOf(minSteps) }
        : null,
      metric: metric.value.trim() || undefined,
      mode: mode.value,
      scheduler: scheduler.value,
      checkpoints: checkpoints.value,
      // fusion is the API's default (where its cost model says it pays): only "off" is sent
      fuse: fuse.checked ? undefined : false,
    };
    // JSON drops the undefined fields: the API's defaults apply
    return JSON.parse(JSON.stringify(b)) as Body;
  };
  const preview = () => {
    previewEl.textContent = JSON.stringify(body(), null, 2);
  };

  /** Fill every field from a request (an example's, or a stored batch's). */
  const fill = (r: Body) => {
    extra = Object.fromEntries(Object.entries(r).filter(([k]) => !FORM_FIELDS.includes(k)));
    const val = (k: string) => (r[k] === undefined || r[k] === null ? "" : String(r[k]));
    name.value = val("name");
    base.value = JSON.stringify(r.base ?? DEFAULT_SPEC, null, 2);
    rows.length = 0;
    spaceBody.replaceChildren();
    for (const [path, dim] of Object.entries((r.space ?? {}) as Body)) addRow(path, dim);
    if (!rows.length) addRow("train.lr", { low: 1e-4, high: 1e-2, log: true });
    method.value = val("method") || "random";
    trials.value = val("trials");
    parallel.value = val("parallel");
    startup.value = val("startup_trials");
    devices.value = val("devices");
    groupSize.value = val("group_size");
    seed.value = val("seed");
    const es = (r.early_stopping ?? null) as Body | null;
    stopping.value = es ? String(es.kind ?? "asha") : "";
    rf.value = es?.reduction_factor === undefined ? "3" : String(es.reduction_factor);
    minSteps.value = es?.min_steps === undefined ? "1" : String(es.min_steps);
    metric.value = val("metric") || "val_loss";
    mode.value = val("mode") || "min";
    scheduler.value = val("scheduler") || "shard-lrtf";
    checkpoints.value = val("checkpoints") || "best";
    fuse.checked = r.fuse !== false;
    clearErrors();
    showFor();
    preview();
  };

  const clearErrors = () => {
    for (const el of errors.values()) {
      el.hidden = true;
      el.textContent = "";
    }
    for (const r of rows) {
      r.error.hidden = true;
      r.error.textContent = "";
    }
    out.className = "";
    out.textContent = "";
  };

  /** Put one problem next to the field it names: a space dimension's row when the message names
   * its path, the base spec for base.*, the form's foot for what names no field of the form. */
  const place = (p: { field: string; message: string }) => {
    const key = fieldOf(p);
    if (key === "space") {
      const path =
        /space(?: path)?\s*\[?'([^']+)'/.exec(p.message)?.[1] ?? p.field.split(".").slice(1).join(".");
      const row = rows.find((r) => r.path.value.trim() === path);
      if (row) {
        row.error.hidden = false;
        row.error.textContent = p.message;
        return;
      }
    }
    const el = errors.get(key) ?? errors.get(key.split(".")[0]) ?? errors.get("form")!;
    el.hidden = false;
    el.textContent =
      (el.textContent ? `${el.textContent}\n` : "") + (key === "form" ? `${p.field}: ` : "") + p.message;
  };

  const submit = async (ev: Event) => {
    ev.preventDefault();
    clearErrors();
    const b = body();
    if (typeof b.base === "string") {
      place({ field: "base", message: "not valid JSON" });
      return;
    }
    try {
      const sel = await post<Selection>("/api/selections", b);
      out.className = "ok";
      out.textContent = `Submitted selection #${sel.id}.`;
      window.location.hash = `#/selections/${sel.id}`;
    } catch (err) {
      for (const p of refusals(err)) place(p);
    }
  };

  root.append(
    h(
      "section",
      {},
      h("div", { class: "title-row" }, title, h("a", { href: "#/selections" }, "all batches")),
      origin,
    ),
    h(
      "form",
      {
        class: "card sel-form",
        id: "selection-form",
        // the API checks every field and its refusal names it; the browser's own checks would
        // stop the submit with a bubble instead
        novalidate: true,
        onsubmit: (ev: Event) => void submit(ev),
      },
      h("div", { class: "form-row" }, h("label", { for: "sel-example", class: "muted" }, "Example"), example),
      field("name", "name", name),
      h(
        "div",
        { class: "field", "data-field": "base" },
        h(
          "label",
          { for: "sel-base" },
          "base JobSpec (JSON): what every trial trains, before its parameters",
        ),
        specTools(base),
        base,
        slot("base"),
      ),
      h(
        "div",
        { class: "field", "data-field": "space" },
        h("h2", {}, "Search space"),
        h(
          "p",
          { class: "muted hint" },
          "A dotted JobSpec path per row: a range (low to high, log-spaced with log, whole numbers with int, grid points with num) or a comma-separated list of choices.",
        ),
        gridTable({ id: "space-table" }, ["parameter", "kind", "values", ""], spaceBody),
        h("datalist", { id: "space-paths" }, ...COMMON_PATHS.map((p) => h("option", { value: p }))),
        h(
          "div",
          { class: "form-row" },
          h(
            "button",
            {
              type: "button",
              class: "small secondary",
              id: "space-add",
              onclick: () => (addRow(), preview()),
            },
            "+ dimension",
          ),
        ),
        slot("space"),
      ),
      h(
        "div",
        { class: "field-grid" },
        h(
          "div",
          { class: "field", "data-field": "method" },
          h("label", { for: "sel-method" }, "method"),
          method,
          methodHint,
          slot("method"),
        ),
        field("trials", "trials", trials, "how many in all"),
        field("parallel", "parallel", parallel, "in flight at once (default: devices)"),
        field("startup_trials", "startup trials", startup, "random ones before the model"),
        field("devices", "devices", devices, "of one worker, shared by a group"),
        field("group_size", "group size", groupSize, "trials per worker group"),
        field("seed", "seed", seed),
      ),
      h(
        "div",
        { class: "field-grid" },
        field("early_stopping", "early stopping", stopping, "rungs at min steps × factor^k"),
        field("early_stopping.reduction_factor", "reduction factor", rf),
        field("early_stopping.min_steps", "first rung (steps)", minSteps),
        field("metric", "metric", metric, "val_loss, loss, or one your code reports"),
        field("mode", "mode", mode),
      ),
      h(
        "datalist",
        { id: "sel-metrics" },
        h("option", { value: "val_loss" }),
        h("option", { value: "loss" }),
      ),
      h(
        "details",
        {},
        h("summary", {}, "more: scheduler, checkpoints, fusion"),
        h(
          "div",
          { class: "field-grid" },
          field("scheduler", "scheduler", scheduler),
          field("checkpoints", "checkpoints kept", checkpoints),
          h(
            "div",
            { class: "field", "data-field": "fuse" },
            h("label", {}, fuse, " fuse same-architecture trials where it pays (off: every trial alone)"),
            slot("fuse"),
          ),
        ),
      ),
      h("details", {}, h("summary", {}, "the request (JSON)"), previewEl),
      slot("form"),
      h("div", { class: "form-row" }, h("button", { type: "submit", id: "sel-submit" }, "Start selection")),
      out,
    ),
  );

  const start = async () => {
    const from = Number(q.get("from")) || null;
    const job = Number(q.get("job")) || null;
    fill(SELECTION_EXAMPLES[Object.keys(SELECTION_EXAMPLES)[0]]);
    origin.textContent = "From an example; pick another, or clone a batch from its page.";
    try {
      if (from) {
        const sel = await api<Selection>(`/api/selections/${from}`);
        if (closed) return;
        fill(sel.request as SelectionRequest as unknown as Body);
        title.textContent = `New selection batch, cloned from #${sel.id}`;
        origin.replaceChildren(
          "The request of ",
          h("a", { href: `#/selections/${sel.id}` }, `batch #${sel.id} · ${sel.name}`),
          ", as it was submitted: change what you like and start it again.",
        );
      } else if (job) {
        const j = await api<Job>(`/api/jobs/${job}`);
        if (closed) return;
        base.value = JSON.stringify(j.spec, null, 2);
        preview();
        origin.replaceChildren(
          "The base is the spec of ",
          h("a", { href: `#/jobs/${j.id}` }, `job #${j.id} · ${j.name}`),
          ".",
        );
      }
    } catch (err) {
      origin.className = "error";
      origin.textContent = `Could not load what to clone: ${errorText(err)}`;
    }
  };
  void start();
  return () => {
    closed = true;
  };
}

/** A refusal as problems, each with the field it names: a 422's `errors` one by one, else its
 * detail ("field: rule", or a sentence), else the error's text. */
export function refusals(err: unknown): FieldProblem[] {
  if (!(err instanceof ApiError)) return [{ field: "form", message: errorText(err), type: "error" }];
  const listed = (err.payload as { errors?: FieldProblem[] } | null)?.errors;
  if (listed?.length) return listed;
  const m = /^([a-z_][\w.]*): ([\s\S]*)$/.exec(err.message);
  return [
    m
      ? { field: m[1], message: m[2], type: "route" }
      : { field: "form", message: err.message, type: "route" },
  ];
}

/** The form field a problem belongs to: `base.model.layers` -> base, `early_stopping.min_steps` as
 * is; a problem of the body as a whole (a rule across fields) by the field its message starts with. */
function fieldOf(p: { field: string; message: string }): string {
  const f = p.field;
  if (f === "base" || f.startsWith("base.")) return "base";
  if (f === "space" || f.startsWith("space.")) return "space";
  if (f.startsWith("early_stopping.")) return f.split(".").slice(0, 2).join(".");
  if (FORM_FIELDS.includes(f)) return f;
  if (f === "body") {
    if (/^method \w+ needs trials/.test(p.message)) return "trials";
    const named =
      /^(startup_trials|parallel|trials|metric|fuse|space|early_stopping|devices|group_size|seed|mode|method|name|scheduler|checkpoints)\b/.exec(
        p.message,
      );
    if (named) return named[1];
  }
  return "form";
}
