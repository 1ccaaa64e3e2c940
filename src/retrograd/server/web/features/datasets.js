// Datasets: upload a file, the table of uploaded ones, a preview of the first examples and
// token counts with a model's tokenizer.

import { api } from "../lib/api.js";
import { attempt, button, describeError, fill, h, table } from "../lib/dom.js";
import { message } from "../lib/conversation.js";
import { bytes, number, when } from "../lib/format.js";

function mediaOf(file) {
  if (/\.(jsonl|ndjson)$/i.test(file.name)) return "application/x-ndjson";
  if (/\.json$/i.test(file.name)) return "application/json";
  return "text/plain";
}

function statsTable(stats) {
  if (!stats || !stats.measured) return h("span", { class: "muted" }, "not measured");
  return ["total_tokens", "p50", "p90", "p99", "max"].map((k) => h("span", { class: "stat" }, `${k} ${number(stats[k])} `));
}

// One example as stored: a text line, a conversation's turns, or a preference pair's parts.
function example(e) {
  if (typeof e === "string") return h("pre", {}, e);
  if (Array.isArray(e.messages)) return h("div", { class: "conversation" }, e.messages.map((m) => message(m)));
  if ("chosen" in e && "rejected" in e) {
    const part = (label, value) => h("div", {}, h("strong", {}, label), Array.isArray(value) ? value.map((m) => message(m)) : h("pre", {}, String(value)));
    return h("div", {}, part("prompt", e.prompt), part("chosen", e.chosen), part("rejected", e.rejected));
  }
  return h("pre", {}, JSON.stringify(e, null, 2));
}

export function render(view) {
  const file = h("input", { type: "file", id: "dataset-file", accept: ".jsonl,.ndjson,.json,.txt,.md" });
  const name = h("input", { id: "dataset-name", placeholder: "optional" });
  const format = h("select", { id: "dataset-format" }, ["auto", "text", "jsonl", "preference-jsonl"].map((f) => h("option", { value: f }, f)));
  const message = h("div", { class: "message" });
  const list = h("div", { id: "datasets" });
  const detail = h("div", { id: "dataset-detail" });
  const model = h("select", { id: "tokenize-model" });

  fill(
    view,
    h("h1", {}, "Datasets"),
    h("form", { class: "card grid", id: "upload" }, h("label", {}, "File ", file), h("label", {}, "Name ", name), h("label", {}, "Format ", format), h("button", { type: "submit" }, "Upload"), message),
    list,
    detail,
  );

  view.querySelector("#upload").addEventListener("submit", (event) => {
    event.preventDefault();
    const chosen = file.files[0];
    if (!chosen) return fill(message, "choose a file first");
    attempt(message, async () => {
      const answer = await api("/datasets", { method: "POST", body: chosen, type: mediaOf(chosen), query: { name: name.value || chosen.name, format: format.value } });
      await refresh();
      return `${answer.id}: ${answer.examples} examples (${answer.format})`;
    });
  });

  async function refresh() {
    await attempt(list, async () => {
      const { datasets } = await api("/datasets", { query: { limit: 500 } });
      if (!datasets.length) return h("p", { class: "muted" }, "No datasets uploaded yet.");
      const rows = datasets.map((d) =>
        h("tr", { "data-dataset": d.id },
          h("td", {}, d.name || ""), h("td", {}, h("code", { title: d.id }, d.id.slice(0, 15) + "…")), h("td", {}, d.format), h("td", {}, d.examples), h("td", {}, bytes(d.bytes)), h("td", {}, statsTable(d.stats)), h("td", {}, when(d.created_at)),
          h("td", { class: "actions" }, button("Preview", () => open(d)), button("Delete", () => remove(d))),
        ),
      );
      return table(["name", "id", "format", "examples", "size", "tokens", "uploaded", ""], rows);
    });
  }

  async function remove(d) {
    try {
      await api(`/datasets/${encodeURIComponent(d.id)}`, { method: "DELETE" });
      fill(detail);
      refresh();
    } catch (error) {
      fill(message, describeError(error));
    }
  }

  function open(d) {
    const preview = h("div", {});
    const tokens = h("div", { class: "message" });
    fill(detail, h("section", { class: "card" },
      h("h2", {}, `Preview: ${d.name || d.id}`),
      preview,
      h("h3", {}, "Tokenization"),
      h("p", {}, "Count tokens with ", model, " ", button("Tokenize", tokenize, { id: "tokenize" })),
      tokens,
    ));
    attempt(preview, async () => {
      const answer = await api(`/datasets/${encodeURIComponent(d.id)}/preview`, { query: { limit: 5 } });
      return h("ol", { class: "examples" }, answer.examples.map((e) => h("li", {}, example(e))));
    });

    function tokenize() {
      attempt(tokens, async () => {
        fill(tokens, "counting…");
        const answer = await api(`/datasets/${encodeURIComponent(d.id)}/tokenize`, { method: "POST", json: { model: model.value } });
        refresh();
        const truncation = Object.entries(answer.truncation || {}).map(([ctx, share]) => h("tr", {}, h("td", {}, ctx), h("td", {}, `${(share * 100).toFixed(1)} %`)));
        return h("div", {}, h("p", {}, statsTable(answer.stats)), table(["longer than (tokens)", "share of examples"], truncation));
      });
    }
  }

  (async () => {
    try {
      const { files } = await api("/model-files");
      fill(model, files.filter((f) => f.role === "model").map((f) => h("option", { value: f.path }, f.name)));
    } catch {
      fill(model, h("option", { value: "" }, "(no model files)"));
    }
  })();
  refresh();
  return null;
}
