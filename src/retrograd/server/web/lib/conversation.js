// Chat messages as the page shows them: a turn per message, tool calls as blocks with their
// arguments, text always as text.

import { h } from "./dom.js";
import { chip, number } from "./format.js";

export function content(value) {
  if (value === null || value === undefined) return "";
  if (typeof value === "string") return value;
  if (Array.isArray(value)) return value.map((part) => (part && part.text) || JSON.stringify(part)).join("\n");
  return JSON.stringify(value, null, 2);
}

function toolCall(call) {
  const fn = call.function || call;
  let args = fn.arguments;
  try {
    args = JSON.stringify(typeof args === "string" ? JSON.parse(args) : args, null, 2);
  } catch {
    // shown as written
  }
  return h("div", { class: "tool-call" }, h("div", { class: "tool-name" }, "→ ", fn.name || "(unnamed tool)", call.id ? h("span", { class: "muted small" }, ` ${call.id}`) : null), h("pre", {}, content(args)));
}

export function message(m, stepReward) {
  return h(
    "div",
    { class: `turn ${m.role}` },
    h("div", { class: "role" }, m.role, m.name ? ` (${m.name})` : "", stepReward !== undefined && stepReward !== null ? chip(`step reward ${number(stepReward)}`, "reward") : null),
    m.content ? h("pre", {}, content(m.content)) : null,
    (m.tool_calls || []).map(toolCall),
  );
}
