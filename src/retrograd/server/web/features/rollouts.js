// The rollout browser of a run with [observe]: its updates, an update's groups sorted by
// reward, a group's members (completions, or conversations with their tool calls), filters.

import { api } from "../lib/api.js";
import { attempt, fill, h, table } from "../lib/dom.js";
import { content, message } from "../lib/conversation.js";
import { chip, number } from "../lib/format.js";

function conversation(conv) {
  const rewards = conv.step_rewards || [];
  let turn = 0;
  return h("div", { class: "conversation" }, conv.messages.map((m) => message(m, m.role === "assistant" ? rewards[turn++] : undefined)));
}

function memberText(member) {
  if (member.completion !== undefined) return content(member.completion);
  if (member.conversation) return member.conversation.messages.map((m) => content(m.content) + (m.tool_calls || []).map((c) => JSON.stringify(c)).join("")).join("\n");
  return "";
}

export function render(view, { parts }) {
  const id = parts[1];
  const base = `/runs/${encodeURIComponent(id)}/trajectories`;
  const minReward = h("input", { type: "number", step: "any", id: "min-reward", placeholder: "any" });
  const trainedOnly = h("input", { type: "checkbox", id: "trained-only" });
  const search = h("input", { type: "search", id: "rollout-search", placeholder: "text in prompt or answer" });
  const updates = h("div", { id: "updates", class: "card" });
  const groups = h("div", { id: "groups", class: "card" });
  const members = h("div", { id: "members" });
  let current = { update: null, rows: [], group: null, detail: null };

  fill(
    view,
    h("p", {}, h("a", { href: `#/runs/${encodeURIComponent(id)}` }, "← run")),
    h("h1", {}, "Rollouts"),
    h("div", { class: "card grid filters" }, h("label", {}, "Reward at least ", minReward), h("label", { class: "inline" }, trainedOnly, " trained only"), h("label", {}, "Search ", search)),
    h("div", { class: "rollouts" }, updates, h("div", {}, groups, members)),
  );

  function passes(reward, trained, text) {
    const min = minReward.value === "" ? null : Number(minReward.value);
    if (min !== null && !(reward !== null && reward !== undefined && reward >= min)) return false;
    if (trainedOnly.checked && !trained) return false;
    const needle = search.value.trim().toLowerCase();
    return !needle || (text || "").toLowerCase().includes(needle);
  }

  function drawGroups() {
    if (current.update === null) return;
    const sorted = [...current.rows].sort((a, b) => (b.reward_mean ?? -Infinity) - (a.reward_mean ?? -Infinity));
    const rows = sorted
      .filter((g) => passes(g.reward_mean, g.trained > 0, g.prompt))
      .map((g) =>
        h("tr", { class: g.group === current.group ? "current" : null, "data-group": String(g.group ?? "-"), onclick: () => openGroup(g.group ?? "-") },
          h("td", {}, String(g.group ?? "-")), h("td", {}, number(g.reward_mean)), h("td", {}, number(g.reward_std)), h("td", {}, `${g.trained}/${g.members}`), h("td", { class: "prompt" }, g.prompt || ""),
        ),
      );
    fill(groups, h("h2", {}, `Update ${current.update}: groups by reward`), rows.length ? table(["group", "reward", "spread", "trained", "prompt"], rows, { class: "clickable" }) : h("p", { class: "muted" }, "no group passes the filters"));
  }

  function drawMembers() {
    const detail = current.detail;
    if (!detail) return fill(members);
    const prompt = detail.prompt && detail.prompt.messages;
    const cards = detail.members
      .filter((m) => passes(m.summary.reward, m.summary.trained === true, memberText(m) + " " + JSON.stringify(prompt || "")))
      .map((m) => {
        const s = m.summary;
        return h("article", { class: "card member", "data-member": String(s.member) },
          h("div", { class: "chips" },
            h("strong", {}, `member ${s.member}`), " ",
            chip(`reward ${number(s.reward)}`, "reward"), chip(`advantage ${number(s.advantage)}`, "event"),
            s.trained === true ? chip("trained", "completed") : chip(s.skip_reason ? `skipped: ${s.skip_reason}` : "not trained", "cancelled"),
            s.truncated ? chip("truncated", "failed") : null,
            s.tokens !== null && s.tokens !== undefined ? chip(`${s.tokens} tokens`, "event") : null,
            s.tool_calls ? chip(`${s.tool_calls} tool calls`, "event") : null,
          ),
          m.conversation ? conversation(m.conversation) : m.completion !== undefined ? h("pre", { class: "completion" }, content(m.completion)) : h("p", { class: "muted" }, "no text kept for this update"),
        );
      });
    fill(members,
      h("section", { class: "card" }, h("h2", {}, `Group ${detail.group}: prompt`), prompt ? prompt.map((m) => message(m)) : h("p", { class: "muted" }, "no prompt text kept")),
      cards.length ? cards : h("p", { class: "muted" }, "no member passes the filters"));
  }

  async function openUpdate(update) {
    current = { update, rows: [], group: null, detail: null };
    fill(members);
    await attempt(groups, async () => {
      let cursor;
      do {
        const page = await api(`${base}/updates/${update}`, { query: { limit: 500, cursor } });
        current.rows.push(...page.groups);
        cursor = page.next_cursor;
      } while (cursor);
      drawGroups();
      return undefined;
    });
  }

  async function openGroup(group) {
    current.group = group;
    drawGroups();
    await attempt(members, async () => {
      current.detail = await api(`${base}/updates/${current.update}/groups/${encodeURIComponent(group)}`);
      drawMembers();
      return undefined;
    });
  }

  for (const input of [minReward, trainedOnly, search]) {
    input.addEventListener("input", () => {
      drawGroups();
      drawMembers();
    });
  }

  attempt(updates, async () => {
    const overview = await api(base);
    if (!overview.observed) return h("p", { class: "muted" }, "This run keeps no rollouts (its run file has no [observe]).");
    if (!overview.updates.length) return h("p", { class: "muted" }, "No update written yet.");
    const rows = overview.updates.map((u) =>
      h("tr", { "data-update": String(u.update), onclick: () => openUpdate(u.update) },
        h("td", {}, u.update), h("td", {}, number(u.reward_mean)), h("td", {}, `${number(u.reward_min)} … ${number(u.reward_max)}`), h("td", {}, u.trained_fraction === null || u.trained_fraction === undefined ? "" : `${Math.round(u.trained_fraction * 100)} %`), h("td", {}, u.texts ? "texts" : ""),
      ),
    );
    return h("div", {}, h("h2", {}, "Updates"), h("p", { class: "muted small" }, `${overview.algorithm || ""} · ${overview.updates.length} updates${overview.every ? ` · texts every ${overview.every}` : ""}`), table(["update", "reward", "range", "trained", ""], rows, { class: "clickable" }));
  });
  return null;
}
