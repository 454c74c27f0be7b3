// Parameter importance of a selection batch and its best-so-far history, computed in the browser from
// the trials the API sends (docs/selection.md, "Parameter importance").
//
// Importance is a first-order variance decomposition, fANOVA's main effects with a step function in
// place of its random forest: the metric's ranks are split by each parameter's value (a choice's
// values, or a numeric parameter's quantile bins), and the share of their variance the split
// explains, corrected for the share any split into that many groups explains by chance (epsilon
// squared), is the parameter's importance. Ranks, not values: one diverged trial must not decide it.

export interface Observation {
  params: Record<string, unknown>;
  value: number;
}

export interface ParamImportance {
  param: string;
  /** Fraction of the explained variance: the shares of all parameters sum to 1 (or are all 0). */
  share: number;
  /** Epsilon squared: the fraction of the metric's rank variance this parameter alone explains. */
  explained: number;
  /** Groups its values were split into. */
  groups: number;
}

/** Fewest observations importance is computed from. */
export const MIN_OBSERVATIONS = 4;

/** Average ranks (1-based), ties sharing the mean of their places. */
export function ranks(values: number[]): number[] {
  const order = values.map((v, i) => [v, i] as const).sort((a, b) => a[0] - b[0]);
  const out = new Array<number>(values.length);
  for (let i = 0; i < order.length;) {
    let j = i;
    while (j + 1 < order.length && order[j + 1][0] === order[i][0]) j++;
    const r = (i + j) / 2 + 1;
    for (let k = i; k <= j; k++) out[order[k][1]] = r;
    i = j + 1;
  }
  return out;
}

/** Group labels of one parameter's values: each distinct value of a choice (or of a numeric one with
 * few values), else quantile bins of about three observations or more each (at most five bins). */
export function groupsOf(values: unknown[]): string[] {
  const keys = values.map((v) => JSON.stringify(v ?? null));
  const distinct = new Set(keys);
  const numeric = values.every((v) => typeof v === "number" && Number.isFinite(v));
  const bins = Math.max(2, Math.min(5, Math.floor(values.length / 3)));
  if (!numeric || distinct.size <= bins) return keys;
  const r = ranks(values as number[]);
  return r.map((x) => String(Math.min(bins - 1, Math.floor(((x - 1) * bins) / values.length))));
}

export function importance(obs: Observation[], params: string[]): ParamImportance[] {
  const n = obs.length;
  if (n < MIN_OBSERVATIONS) return [];
  const y = ranks(obs.map((o) => o.value));
  const mean = y.reduce((a, b) => a + b, 0) / n;
  const total = y.reduce((a, v) => a + (v - mean) ** 2, 0);
  const out: ParamImportance[] = [];
  for (const param of params) {
    const labels = groupsOf(obs.map((o) => o.params[param]));
    const sums = new Map<string, { s: number; c: number }>();
    labels.forEach((g, i) => {
      const acc = sums.get(g) ?? { s: 0, c: 0 };
      acc.s += y[i];
      acc.c += 1;
      sums.set(g, acc);
    });
    const k = sums.size;
    let between = 0;
    for (const { s, c } of sums.values()) between += c * (s / c - mean) ** 2;
    const within = total - between;
    // epsilon squared: what k groups explain of pure noise is about (k - 1) within-group mean squares
    const explained =
      k < 2 || n <= k || total <= 0 ? 0 : Math.max(0, (between - ((k - 1) * within) / (n - k)) / total);
    out.push({ param, share: 0, explained, groups: k });
  }
  const sum = out.reduce((a, p) => a + p.explained, 0);
  for (const p of out) p.share = sum > 0 ? p.explained / sum : 0;
  return out.sort((a, b) => b.share - a.share || a.param.localeCompare(b.param));
}

/** Best value so far after each observation, in the order given (`mode` says which way is better). */
export function bestSoFar(values: number[], mode: string): number[] {
  const better = (a: number, b: number) => (mode === "max" ? a > b : a < b);
  const out: number[] = [];
  for (const v of values) out.push(out.length && !better(v, out[out.length - 1]) ? out[out.length - 1] : v);
  return out;
}
