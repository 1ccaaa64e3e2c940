// Compare: the same conversation with a run (RUN_ID, or RUN_ID@best, @step-N, ...) and with
// its base model (RUN_ID@base) side by side, through POST /v1/chat/completions.

import { api } from "../lib/api.js";
import { describeError, fill, h } from "../lib/dom.js";

function pane(label, target) {
  const log = h("div", { class: "chat-log" });
  const element = h("section", { class: "card chat" }, h("h2", {}, label, " ", target), log);
  return { element, log, messages: [] };
}

export function render(view, { query }) {
  const run = h("select", { id: "compare-run" });
  const left = h("input", { id: "compare-left", placeholder: "RUN_ID or RUN_ID@best, @final, @step-N, @latest" });
  const right = h("input", { id: "compare-right", placeholder: "RUN_ID@base" });
  const prompt = h("textarea", { id: "compare-prompt", rows: 3, placeholder: "Say something to both" });
  const maxTokens = h("input", { type: "number", id: "compare-max", min: 1, value: 64 });
  const temperature = h("input", { type: "number", id: "compare-temperature", min: 0, step: 0.1, value: 0 });
  const panes = h("div", { class: "columns" });
  const message = h("div", { class: "message" });
  let sides = [];

  fill(
    view,
    h("h1", {}, "Compare"),
    h("div", { class: "card grid" }, h("label", {}, "Run ", run), h("label", {}, "Left ", left), h("label", {}, "Right ", right), h("label", {}, "Max tokens ", maxTokens), h("label", {}, "Temperature ", temperature)),
    panes,
    h("form", { class: "card", id: "compare-form" }, prompt, h("p", {}, h("button", { type: "submit", class: "primary" }, "Send"), " ", h("button", { type: "button", id: "compare-clear" }, "New conversation")), message),
  );

  function reset() {
    sides = [pane("left", left.value), pane("right", right.value)];
    fill(panes, sides.map((side) => side.element));
  }

  function choose(id) {
    left.value = id;
    right.value = `${id}@base`;
    reset();
  }

  run.addEventListener("change", () => choose(run.value));
  left.addEventListener("change", reset);
  right.addEventListener("change", reset);
  view.querySelector("#compare-clear").addEventListener("click", reset);
  view.querySelector("#compare-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    const text = prompt.value.trim();
    if (!text) return;
    prompt.value = "";
    fill(message);
    // one after the other: the server holds one served model at a time
    for (const [i, side] of sides.entries()) await ask(side, [left, right][i].value, text);
  });

  async function ask(side, model, text) {
    side.messages.push({ role: "user", content: text });
    side.log.append(h("div", { class: "turn user" }, h("strong", {}, "you"), h("pre", {}, text)));
    const waiting = h("div", { class: "turn assistant muted" }, "…");
    side.log.append(waiting);
    try {
      const answer = await api("/chat/completions", {
        method: "POST",
        json: { model, messages: side.messages, max_tokens: Number(maxTokens.value) || 64, temperature: Number(temperature.value) },
      });
      const content = answer.choices[0].message.content || "";
      side.messages.push({ role: "assistant", content });
      fill(waiting, h("strong", {}, "model"), h("pre", {}, content));
      waiting.classList.remove("muted");
    } catch (error) {
      side.messages.pop();
      fill(waiting, describeError(error));
      waiting.classList.add("error");
    }
  }

  (async () => {
    try {
      const { runs } = await api("/runs", { query: { limit: 100 } });
      fill(run, h("option", { value: "" }, "(choose a run)"), runs.map((r) => h("option", { value: r.id }, `${r.name || r.id} · ${r.status}`)));
    } catch (error) {
      fill(message, describeError(error));
    }
    const wanted = query.get("run");
    if (wanted) {
      run.value = wanted;
      choose(wanted);
    } else {
      reset();
    }
  })();
  return null;
}
