// A new run: pick a model file and a dataset, write or edit the run's TOML (or a recipe where
// the server takes them), Plan to see the effective configuration with where each value came
// from and the memory plan, then Start.

import { api } from "../lib/api.js";
import { attempt, button, fill, h, table } from "../lib/dom.js";
import { bytes, leaves, show } from "../lib/format.js";
import { configTable } from "./config_table.js";

const TEMPLATE = `[run]
algorithm = "sft"

[model]
path = ""

[lora]
rank = 8

[training]
lr = 2e-4
epochs = 1

[sft]
data = ""
`;
const OBJECTIVES = ["instruction-tuning", "reasoning-rl", "preference-rl", "agentic", "preference-tuning"];

// The TOML text with `key = value` set in `[table]`: the line replaced, or added to the table
// (the table added at the end when missing). Values are TOML strings.
export function setKey(text, tableName, key, value) {
  const quoted = JSON.stringify(value);
  const lines = text.split("\n");
  const start = lines.findIndex((line) => line.trim() === `[${tableName}]`);
  if (start < 0) return `${text.replace(/\n*$/, "\n")}\n[${tableName}]\n${key} = ${quoted}\n`;
  let end = lines.findIndex((line, i) => i > start && /^\s*\[/.test(line));
  if (end < 0) end = lines.length;
  const pattern = new RegExp(`^\\s*${key}\\s*=`);
  const at = lines.findIndex((line, i) => i > start && i < end && pattern.test(line));
  if (at >= 0) lines[at] = `${key} = ${quoted}`;
  else lines.splice(start + 1, 0, `${key} = ${quoted}`);
  return lines.join("\n");
}

function algorithmOf(text) {
  const match = text.match(/^\s*algorithm\s*=\s*"([^"]+)"/m);
  return match ? match[1] : "sft";
}

// plan.memory: its figures, each post of the estimate, and what a calibration measured.
function memoryTable(memory) {
  const rows = [];
  const shown = (key, value) => (typeof value === "number" && /bytes$/.test(key) ? bytes(value) : show(value));
  for (const [key, value] of Object.entries(memory)) {
    if (key === "posts" && Array.isArray(value)) {
      for (const post of value) rows.push(h("tr", { class: "post" }, h("td", {}, h("code", {}, post.post)), h("td", {}, bytes(post.bytes))));
    } else {
      for (const [path, inner] of leaves(value, key)) rows.push(h("tr", {}, h("td", {}, h("code", {}, path)), h("td", {}, shown(path, inner))));
    }
  }
  return h("div", { id: "memory" }, h("h3", {}, "Memory"), table(["", ""], rows, { class: "memory" }));
}

export function render(view, { features }) {
  const model = h("select", { id: "model" }, h("option", { value: "" }, "(loading model files…)"));
  const dataset = h("select", { id: "dataset" }, h("option", { value: "" }, "(a file named in the TOML)"));
  const name = h("input", { id: "run-name", placeholder: "optional" });
  const toml = h("textarea", { id: "toml", rows: 22, spellcheck: "false" });
  toml.value = TEMPLATE;
  const objective = h("select", { id: "objective" }, OBJECTIVES.map((o) => h("option", { value: o }, o)));
  const amount = h("input", { id: "budget", type: "number", min: 1, value: 1 });
  const reward = h("select", { id: "reward" }, h("option", { value: "" }, "(none)"));
  const recipeMessage = h("div", { class: "message", id: "recipe-message" });
  const result = h("div", { id: "plan-result" });
  const message = h("div", { class: "message", id: "plan-message" });

  fill(
    view,
    h("h1", {}, "New run"),
    h("div", { class: "card grid" },
      h("label", {}, "Model file ", model),
      h("label", {}, "Dataset ", dataset),
      h("label", {}, "Name ", name),
    ),
    h("details", { class: "card", id: "recipe" },
      h("summary", {}, "From a recipe (the server picks the settings)"),
      h("div", { class: "grid" }, h("label", {}, "Objective ", objective), h("label", {}, "Epochs (tuning) or updates (RL) ", amount), h("label", {}, "Reward ", reward)),
      button("Plan recipe", () => send("/plan", true), { id: "plan-recipe" }), " ",
      button("Start recipe", () => send("/runs", true), { id: "start-recipe" }),
      recipeMessage,
    ),
    h("div", { class: "card" },
      h("h2", {}, "Run file (TOML)"),
      h("p", { class: "muted" }, "The model and dataset pickers write their value into this text; paths are the server's."),
      toml,
      h("p", {}, button("Plan", () => send("/plan", false), { id: "plan" }), " ", button("Start", () => send("/runs", false), { id: "start", class: "primary" })),
      message,
    ),
    result,
  );

  model.addEventListener("change", () => {
    if (model.value) toml.value = setKey(toml.value, "model", "path", model.value);
  });
  dataset.addEventListener("change", () => {
    if (dataset.value) toml.value = setKey(toml.value, algorithmOf(toml.value), "data", dataset.value);
  });

  function recipe() {
    const tuning = objective.value.endsWith("-tuning");
    const body = { objective: objective.value, model: model.value, budget: { [tuning ? "epochs" : "updates"]: Number(amount.value) || 1 } };
    if (dataset.value) body.data = { dataset: dataset.value };
    if (reward.value) body.reward = { id: reward.value };
    return body;
  }

  async function send(route, fromRecipe) {
    const where = fromRecipe ? recipeMessage : message;
    await attempt(where, async () => {
      let answer;
      try {
        answer = fromRecipe
          ? await api(route, { method: "POST", json: { recipe: recipe(), ...(name.value ? { name: name.value } : {}) } })
          : await api(route, { method: "POST", body: toml.value, type: "application/toml", query: { name: name.value } });
      } catch (error) {
        if (fromRecipe && error.status === 501) throw new Error("This server does not take recipes yet: write the run as TOML below.");
        throw error;
      }
      if (route === "/runs") {
        location.hash = `#/runs/${encodeURIComponent(answer.id)}`;
        return;
      }
      showPlan(answer);
      return "planned: the effective configuration is below";
    });
  }

  function showPlan(answer) {
    const plan = answer.plan || {};
    const facts = [
      plan.total_steps !== undefined ? `${plan.total_steps} optimizer steps` : null,
      plan.iterations !== undefined ? `${plan.iterations} iterations` : null,
    ].filter(Boolean);
    fill(
      result,
      h("section", { class: "card" },
        h("h2", {}, "Plan"),
        facts.length ? h("p", {}, facts.join(" · ")) : null,
        (plan.warnings || []).length ? h("ul", { class: "warnings" }, plan.warnings.map((w) => h("li", {}, h("code", {}, w.code), " ", w.field ? `${w.field}: ` : "", w.message))) : null,
        plan.memory ? memoryTable(plan.memory) : null,
        h("h3", {}, "Effective configuration"),
        configTable(answer.effective_config, answer.provenance),
      ),
    );
  }

  (async () => {
    try {
      const { files } = await api("/model-files");
      fill(model, h("option", { value: "" }, files.length ? "(choose a model file)" : "(no model files under the server's path roots)"), files.filter((f) => f.role === "model").map((f) => h("option", { value: f.path }, `${f.name} · ${f.architecture || "?"} · ${bytes(f.bytes)}`)));
    } catch (error) {
      fill(model, h("option", { value: "" }, `(model files unavailable: ${error.message})`));
    }
    try {
      const { datasets } = await api("/datasets", { query: { limit: 100 } });
      dataset.append(...datasets.map((d) => h("option", { value: d.id }, `${d.name || d.id} · ${d.format} · ${d.examples} examples`)));
    } catch {
      // the TOML can still name a file
    }
    try {
      const { rewards } = await api("/rewards");
      reward.append(...rewards.map((r) => h("option", { value: r.id }, `${r.id}: ${r.description || ""}`)));
    } catch {
      // a recipe without a reward
    }
  })();
  return null;
}
