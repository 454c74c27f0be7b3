// The signed-in user's webhooks: add one (its signing secret is shown once), list, delete, and
// each one's delivery log.
import { api, post, type Webhook, type WebhookDeliveries, type WebhookIssued, type Webhooks } from "../api";
import { badge, errorText, fmtTime, gridTable, h } from "../dom";

export function webhooksPage(root: HTMLElement): () => void {
  const url = h("input", {
    id: "webhook-url",
    type: "url",
    placeholder: "https://example.com/hooks",
    size: 48,
  });
  const events = h(
    "select",
    { id: "webhook-events" },
    h("option", { value: "all" }, "every end"),
    h("option", { value: "failures" }, "failures only"),
  );
  const out = h("div", { id: "webhook-result", role: "status" });
  const tbody = h("tbody");
  const log = h("section", { id: "webhook-deliveries" });

  const showDeliveries = async (hook: Webhook) => {
    try {
      const page = await api<WebhookDeliveries>(`/api/webhooks/${hook.id}/deliveries`);
      log.replaceChildren(
        h("h2", {}, `Deliveries to ${hook.url}`),
        gridTable(
          {},
          ["id", "event", "of", "state", "attempts", "last"],
          h(
            "tbody",
            {},
            ...page.items.map((d) => {
              const last = d.attempts[d.attempts.length - 1];
              return h(
                "tr",
                { "data-delivery-id": d.id },
                h("td", {}, d.id),
                h("td", {}, d.event),
                h("td", {}, `${d.object_id} (${d.status})`),
                h(
                  "td",
                  {},
                  badge(d.state === "delivered" ? "succeeded" : d.state === "failed" ? "failed" : "queued"),
                ),
                h("td", { class: "num" }, d.attempts.length),
                h("td", {}, last ? `${fmtTime(last.at)}: ${last.status_code ?? last.error ?? ""}` : "—"),
              );
            }),
          ),
        ),
      );
      if (!page.items.length) log.append(h("p", { class: "muted" }, "Nothing delivered yet."));
    } catch (err) {
      log.replaceChildren(h("p", { class: "error" }, errorText(err)));
    }
  };

  const load = async () => {
    try {
      const page = await api<Webhooks>("/api/webhooks");
      tbody.replaceChildren(
        ...page.items.map((w) =>
          h(
            "tr",
            { "data-webhook-id": w.id },
            h("td", {}, w.id),
            h("td", {}, w.url),
            h("td", {}, w.events),
            h("td", {}, fmtTime(w.created_at)),
            h(
              "td",
              {},
              h("button", { class: "small secondary", onclick: () => void showDeliveries(w) }, "Deliveries"),
              " ",
              h(
                "button",
                {
                  class: "small secondary",
                  onclick: async () => {
                    try {
                      await api(`/api/webhooks/${w.id}`, { method: "DELETE" });
                      await load();
                    } catch (err) {
                      out.className = "error";
                      out.textContent = errorText(err);
                    }
                  },
                },
                "Delete",
              ),
            ),
          ),
        ),
      );
      if (!page.items.length)
        tbody.append(h("tr", {}, h("td", { colspan: 5, class: "muted" }, "No webhooks yet.")));
    } catch (err) {
      tbody.replaceChildren(h("tr", {}, h("td", { colspan: 5, class: "error" }, errorText(err))));
    }
  };

  const add = async (ev: Event) => {
    ev.preventDefault();
    out.className = "";
    try {
      const made = await post<WebhookIssued>("/api/webhooks", {
        url: url.value.trim(),
        events: events.value,
      });
      url.value = "";
      out.replaceChildren(
        "Added. Its signing secret, shown only now: ",
        h("code", { id: "webhook-secret" }, made.secret),
      );
      await load();
    } catch (err) {
      out.className = "error";
      out.textContent = errorText(err);
    }
  };

  root.append(
    h("h1", {}, "Webhooks"),
    h(
      "form",
      { class: "card", id: "webhook-form", onsubmit: add },
      h("p", { class: "muted" }, "A signed POST when one of your jobs or batches ends (docs/operations.md)."),
      url,
      " ",
      events,
      " ",
      h("button", { type: "submit" }, "Add"),
      out,
    ),
    gridTable({ id: "webhooks-table" }, ["id", "url", "events", "created", ""], tbody),
    log,
  );
  void load();
  return () => undefined;
}
