// Parallel coordinates of a selection's trials, built as SVG from data: one vertical axis per
// hyperparameter plus one for the metric, one polyline per trial in the trial's own colour (the
// one its curve has on the page), the best trial's drawn thickest and on top.
// The npm parallel-coordinates packages pull in all of d3 for what is a few dozen lines here.
import { lookup, type Selection, type Trial } from "./api";
import { svg } from "./dom";

const H = 320;
const TOP = 34;
const BOTTOM = 26;
const SIDE = 70;
/** Room right of the last axis for its tick labels. */
const RIGHT = 90;

/** What an axis places: a parameter's value (a list one, shown as its JSON), or the metric. */
type Value = number | string | boolean;

function asValue(v: unknown): Value | undefined {
  if (v === null || v === undefined) return undefined;
  return typeof v === "number" || typeof v === "string" || typeof v === "boolean" ? v : JSON.stringify(v);
}

interface Axis {
  key: string;
  label: string;
  /** Maps a value to [0, 1] (0 at the bottom); null when the trial has none. */
  pos: (v: Value | null | undefined) => number | null;
  ticks: { at: number; label: string }[];
}

export function parallelCoordinates(opts: {
  trials: Trial[];
  space: Selection["space"];
  metric: string;
  mode: string;
  /** The batch's base JobSpec: a trial without a parameter (added later with extra keys) has its value. */
  base?: Record<string, unknown>;
  /** A trial's colour; by default a ramp from the best trial (dark blue) to the worst (orange). */
  colour?: (t: Trial) => string;
  /** The width to fill (its card's); narrower cards scroll rather than squeeze the axes. */
  width?: number;
}): SVGElement {
  const { trials, space, metric, mode, base } = opts;
  const keys = [...new Set([...Object.keys(space), ...trials.flatMap((t) => Object.keys(t.params))])];
  const param = (t: Trial, k: string): Value | undefined => asValue(t.params[k] ?? lookup(base, k));
  const axes: Axis[] = keys.map((k) =>
    makeAxis(
      k,
      k,
      trials.map((t) => param(t, k)),
      space[k],
    ),
  );
  axes.push(
    makeAxis(
      "__metric",
      `best ${metric}`,
      trials.map((t) => t.best_metric),
      undefined,
    ),
  );

  // fill the card; at least 160 px between axes so tick labels never collide
  const W = Math.max(opts.width ?? 0, SIDE + RIGHT + 160 * (axes.length - 1), 480);
  const root = svg("svg", {
    viewBox: `0 0 ${W} ${H}`,
    width: W,
    height: H,
    "data-width": W,
    class: "parcoords",
    role: "img",
    "aria-label": "parallel coordinates",
  });
  const ax = (i: number) => SIDE + (axes.length > 1 ? (i * (W - SIDE - RIGHT)) / (axes.length - 1) : 0);
  const ay = (p: number) => TOP + (1 - p) * (H - TOP - BOTTOM);

  // colour by rank of the best metric so the winners stand out whatever the spread of values
  const scored = trials
    .filter((t) => t.best_metric !== null)
    .sort((a, b) => (a.best_metric! - b.best_metric!) * (mode === "min" ? 1 : -1));
  const rank = new Map(scored.map((t, i) => [t.id, scored.length > 1 ? i / (scored.length - 1) : 0]));

  // draw worst first so the best lines sit on top
  const order = [...trials].sort((a, b) => (rank.get(b.id) ?? 2) - (rank.get(a.id) ?? 2));
  for (const t of order) {
    const pts: string[] = [];
    axes.forEach((a, i) => {
      const p = a.pos(a.key === "__metric" ? t.best_metric : param(t, a.key));
      if (p !== null) pts.push(`${ax(i).toFixed(1)},${ay(p).toFixed(1)}`);
    });
    if (pts.length < 2) continue;
    const r = rank.get(t.id);
    const line = svg("polyline", {
      points: pts.join(" "),
      class: `trial-line${t.stopped_early ? " stopped" : ""}${r === 0 ? " best" : ""}`,
      stroke: r === undefined ? "#aaa" : (opts.colour?.(t) ?? rampColour(r)),
      "data-trial": t.id,
      "data-index": t.index,
    });
    const params = Object.entries(t.params)
      .map(([k, v]) => `${k}=${v}`)
      .join(", ");
    line.append(
      svg(
        "title",
        {},
        `trial ${t.index}: ${params} → ${metric} ${t.best_metric ?? "—"}${t.stopped_early ? " (stopped early)" : ""}`,
      ),
    );
    root.append(line);
  }

  axes.forEach((a, i) => {
    const x = ax(i);
    root.append(svg("line", { x1: x, x2: x, y1: ay(1), y2: ay(0), class: "pc-axis" }));
    root.append(svg("text", { x, y: TOP - 16, "text-anchor": "middle", class: "pc-label" }, a.label));
    for (const tk of a.ticks) {
      root.append(
        svg("line", { x1: x - 3, x2: x + 3, y1: ay(tk.at), y2: ay(tk.at), class: "pc-axis" }),
        // the first axis' labels go left of it, into the margin, clear of the lines
        i === 0
          ? svg("text", { x: x - 6, y: ay(tk.at) + 4, "text-anchor": "end", class: "pc-tick" }, tk.label)
          : svg("text", { x: x + 6, y: ay(tk.at) + 4, class: "pc-tick" }, tk.label),
      );
    }
  });
  return root;
}

function makeAxis(
  key: string,
  label: string,
  values: (Value | null | undefined)[],
  entry: Selection["space"][string] | undefined,
): Axis {
  const present = values.filter((v): v is Value => v !== null && v !== undefined);
  const choices = Array.isArray(entry) ? entry : null;
  const numeric =
    present.every((v) => typeof v === "number") && (!choices || choices.every((c) => typeof c === "number"));

  if (!numeric) {
    // categorical: spread the choices evenly
    const cats = [...new Set([...(choices ?? []), ...present].map(String))];
    const at = (i: number) => (cats.length > 1 ? i / (cats.length - 1) : 0.5);
    return {
      key,
      label,
      pos: (v) => (v === null || v === undefined ? null : at(cats.indexOf(String(v)))),
      ticks: cats.map((c, i) => ({ at: at(i), label: c })),
    };
  }

  const nums = [...(present as number[]), ...((choices as number[] | null) ?? [])];
  const range = entry && !Array.isArray(entry) ? entry : null;
  let lo = Math.min(...nums, ...(range ? [range.low] : []));
  let hi = Math.max(...nums, ...(range ? [range.high] : []));
  // log scale when the space says so, or for a list of positive choices spanning decades (lr grids)
  const log = lo > 0 && (range ? Boolean(range.log) : hi / lo >= 20);
  const f = log ? Math.log10 : (v: number) => v;
  if (!Number.isFinite(lo)) [lo, hi] = [0, 1];
  const flo = f(lo);
  const fhi = f(hi);
  const pos = (v: Value | null | undefined) => {
    if (typeof v !== "number") return null;
    return fhi > flo ? (f(v) - flo) / (fhi - flo) : 0.5;
  };
  // five ticks over a range (evenly spaced in the axis' own scale), every choice of a list
  const tickValues = choices
    ? [...new Set(choices as number[])]
    : [0, 0.25, 0.5, 0.75, 1].map((k) => (log ? 10 ** (flo + k * (fhi - flo)) : lo + k * (hi - lo)));
  return {
    key,
    label: log ? `${label} (log)` : label,
    pos,
    ticks: [...new Set(tickValues)].map((v) => ({ at: pos(v) ?? 0.5, label: fmt(v) })),
  };
}

function fmt(v: number): string {
  if (v !== 0 && (Math.abs(v) < 1e-2 || Math.abs(v) >= 1e4)) return v.toExponential(1);
  return Number(v.toPrecision(3)).toString();
}

// best (0) to worst (1): dark blue, purple, pink, orange (the plasma ramp without its pale end,
// which would vanish on the light background)
const RAMP = [
  [13, 8, 135],
  [126, 3, 168],
  [204, 71, 120],
  [248, 149, 64],
];

function rampColour(r: number): string {
  const x = Math.min(1, Math.max(0, r)) * (RAMP.length - 1);
  const i = Math.min(RAMP.length - 2, Math.floor(x));
  const f = x - i;
  const c = RAMP[i].map((v, k) => Math.round(v + (RAMP[i + 1][k] - v) * f));
  return `rgb(${c.join(",")})`;
}
