// Submit-form helpers for users' own models and data: example specs for every model and data kind,
// and a workspace upload (.tar.gz or .zip) whose reference goes into the spec's `workspace`.
import { ApiError, csrfToken, describeDetail, signedOut, type Workspace } from "./api";
import { errorText, h } from "./dom";

const TRAIN = { steps: 100, batch_size: 16, lr: 0.001, optimizer: "adamw", seed: 0, eval_every: 20 };

/** One example JobSpec per kind; the user edits the JSON before submitting. */
export const TEMPLATES: Record<string, Record<string, unknown>> = {
  "gpt on stdlib text": {
    name: "tiny-gpt",
    model: { kind: "gpt", layers: 2, d_model: 64, heads: 4, seq_len: 32 },
    data: { kind: "text", corpus: "stdlib" },
    train: TRAIN,
  },
  "llama, byte-level text file": {
    name: "tiny-llama",
    model: { kind: "llama", layers: 2, d_model: 64, heads: 4, kv_heads: 2, seq_len: 64 },
    data: { kind: "text", path: "corpus.txt", tokenizer: "byte" },
    train: TRAIN,
  },
  "llama, tokenizers JSON": {
    name: "llama-bpe",
    model: { kind: "llama", layers: 2, d_model: 64, heads: 4, seq_len: 64 },
    data: { kind: "text", path: "corpus.txt", tokenizer: "tokenizer.json" },
    train: TRAIN,
  },
  "gpt on train.bin/val.bin": {
    name: "gpt-tokens",
    model: { kind: "gpt", layers: 2, d_model: 64, heads: 4, seq_len: 64 },
    data: { kind: "tokens", path: "/data/my-corpus", dtype: "uint16", vocab_size: 50304 },
    train: TRAIN,
  },
  "your model (python entry point)": {
    name: "my-model",
    model: { kind: "python", entry: "mymodel.recipe:make", args: { width: 64 }, seq_len: 64 },
    data: { kind: "text", path: "corpus.txt", tokenizer: "byte" },
    train: TRAIN,
  },
  "your data (python entry point)": {
    name: "my-data",
    model: { kind: "gpt", layers: 2, d_model: 64, heads: 4, seq_len: 32 },
    data: { kind: "python", entry: "mydata.batches:make", args: {}, vocab_size: 256 },
    train: TRAIN,
  },
};

export async function uploadWorkspace(file: File): Promise<Workspace> {
  // the archive is the body itself, so not api(): same session cookie and CSRF header though
  const res = await fetch(`/api/workspaces?name=${encodeURIComponent(file.name)}`, {
    method: "POST",
    headers: { "Content-Type": "application/octet-stream", "X-CSRF-Token": csrfToken() },
    credentials: "same-origin",
    body: file,
  });
  const payload = (await res.json().catch(() => null)) as { detail?: unknown } | null;
  if (res.status === 401) signedOut(String(payload?.detail ?? "signed out"));
  if (!res.ok) throw new ApiError(res.status, describeDetail(payload?.detail ?? res.statusText));
  return payload as unknown as Workspace;
}

/** A template picker and a workspace upload, both editing the spec in `text`. */
export function specTools(text: HTMLTextAreaElement): HTMLElement {
  const pick = h("select", { id: "spec-template" }) as HTMLSelectElement;
  for (const name of Object.keys(TEMPLATES)) pick.append(h("option", { value: name }, name));
  pick.onchange = () => {
    const current = safeParse(text.value);
    const next: Record<string, unknown> = { ...TEMPLATES[pick.value] };
    if (current?.workspace) next.workspace = current.workspace;
    text.value = JSON.stringify(next, null, 2);
  };
  const file = h("input", {
    type: "file",
    id: "workspace-file",
    accept: ".tar.gz,.tgz,.zip,application/gzip,application/zip",
  }) as HTMLInputElement;
  const status = h("span", { id: "workspace-status", class: "muted", role: "status" });
  file.onchange = async () => {
    const chosen = file.files?.[0];
    if (!chosen) return;
    status.className = "muted";
    status.textContent = `uploading ${chosen.name}…`;
    try {
      const ws = await uploadWorkspace(chosen);
      const spec = safeParse(text.value) ?? {};
      spec.workspace = ws.ref;
      text.value = JSON.stringify(spec, null, 2);
      status.className = "ok";
      status.textContent = `workspace #${ws.id} (${ws.size.toLocaleString()} bytes) set in the spec`;
    } catch (err) {
      status.className = "error";
      status.textContent = errorText(err);
    }
  };
  return h(
    "div",
    { class: "form-row", id: "spec-tools" },
    h("label", { for: "spec-template", class: "muted" }, "Example"),
    pick,
    h("label", { for: "workspace-file", class: "muted" }, "Workspace (.tar.gz or .zip)"),
    file,
    status,
  );
}

function safeParse(raw: string): Record<string, unknown> | null {
  try {
    const v = JSON.parse(raw);
    return v && typeof v === "object" ? (v as Record<string, unknown>) : null;
  } catch {
    return null;
  }
}
