// Small DOM helpers so pages read as structure rather than string concatenation.

type Child = Node | string | number | null | undefined | false;
type Attrs = Record<string, string | number | boolean | null | undefined | ((ev: Event) => void)>;

export function h<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  attrs: Attrs = {},
  ...children: Child[]
): HTMLElementTagNameMap[K] {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (typeof value === "function") el.addEventListener(key.replace(/^on/, ""), value);
    else if (key === "class") el.className = String(value);
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  append(el, children);
  return el;
}

export function append(el: Element, children: Child[]): void {
  for (const c of children) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : String(c));
  }
}

const SVG_NS = "http://www.w3.org/2000/svg";

export function svg(tag: string, attrs: Record<string, string | number> = {}, text?: string): SVGElement {
  const el = document.createElementNS(SVG_NS, tag) as SVGElement;
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  if (text !== undefined) el.textContent = text;
  return el;
}

export function badge(status: string): HTMLSpanElement {
  return h("span", { class: `badge status-${status}`, "data-status": status }, status.replace("_", " "));
}

/** A run whose loss ended far above where it began (the API's `diverged`), with its numbers as the
 * tooltip: shown beside the status, which stays what the run did. */
export function divergedBadge(job: {
  diverged?: boolean;
  divergence?: string | null;
}): HTMLSpanElement | null {
  if (!job.diverged) return null;
  return h(
    "span",
    { class: "badge status-diverged", "data-diverged": "1", title: job.divergence ?? "the loss diverged" },
    "diverged",
  );
}

export function progressBar(done: number, total: number): HTMLDivElement {
  const pct = total > 0 ? Math.min(100, (100 * done) / total) : 0;
  const bar = h("div", { class: "progress", title: `${done}/${total}` }, h("div", { class: "fill" }));
  (bar.firstElementChild as HTMLElement).style.width = `${pct.toFixed(1)}%`;
  bar.append(h("span", { class: "label" }, `${done}/${total}`));
  return bar;
}

export function fmtNum(v: number | null | undefined, digits = 4): string {
  if (v === null || v === undefined || Number.isNaN(v)) return "—";
  if (v !== 0 && (Math.abs(v) < 1e-3 || Math.abs(v) >= 1e5)) return v.toExponential(2);
  return Number(v.toPrecision(digits)).toString();
}

/** Timestamps come as ISO strings (REST) or unix seconds (events). */
export function fmtTime(t: string | number | null | undefined): string {
  if (t === null || t === undefined || t === "") return "—";
  const d = typeof t === "number" ? new Date(t * 1000) : new Date(t);
  if (Number.isNaN(d.getTime())) return String(t);
  return d.toLocaleString(undefined, { hour12: false });
}

export function errorText(err: unknown): string {
  return err instanceof Error ? err.message : String(err);
}

/** The JSON in `text` (as `value`), or null once `out` shows why it is not valid JSON. */
export function parsedJson(text: string, out: HTMLElement): { value: unknown } | null {
  try {
    return { value: JSON.parse(text) };
  } catch (err) {
    out.className = "error";
    out.textContent = `Not valid JSON: ${errorText(err)}`;
    return null;
  }
}

/** A <table class="grid"> (`attrs`: its id) with one header row of `columns` over `body`. */
export function gridTable(attrs: Attrs, columns: string[], body: Child): HTMLTableElement {
  return h(
    "table",
    { class: "grid", ...attrs },
    h("thead", {}, h("tr", {}, ...columns.map((c) => h("th", {}, c)))),
    body,
  );
}

/** replaceChildren that, like h(), skips null/false children. */
export function replace(el: Element, ...children: Child[]): void {
  el.replaceChildren();
  append(el, children);
}

/** One labelled value of a <dl class="facts">. */
export function fact(label: string, value: Child): HTMLDivElement {
  return h("div", {}, h("dt", {}, label), h("dd", {}, value));
}

/** 75 s -> "1:15", 3725 s -> "1:02:05". */
export function clock(seconds: number): string {
  const s = Math.max(0, Math.round(seconds));
  const mm = String(Math.floor(s / 60) % 60).padStart(2, "0");
  const ss = String(s % 60).padStart(2, "0");
  return s >= 3600 ? `${Math.floor(s / 3600)}:${mm}:${ss}` : `${Math.floor(s / 60)}:${ss}`;
}
