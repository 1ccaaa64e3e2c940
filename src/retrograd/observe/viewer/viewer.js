// Retrograd rollout viewer: plain JavaScript, no build step, no network.
//
// The run writes feed/index.js (run, segments, one row per update) and feed/update-NNNNNN.js
// (one update's groups and texts); each calls retrogradFeed(data). They are loaded as <script>
// elements because a file:// page may not fetch() JSON, and reloaded every few seconds while
// the run writes. Text from the run is only ever put in the page as text (never as HTML).
"use strict";

(function () {
  const REFRESH_MS = 3000;
  const CURVES = [
    ["reward", "mean reward"],
    ["trained", "trained fraction"],
    ["length", "completion length (tokens)"],
    ["kl", "KL"],
  ];
  const state = {
    index: null,
    generation: null,
    selected: null, // update number shown
    view: null, // its feed/update file
    focus: 0, // index of the focused group among those shown
    filter: "all",
    sideBySide: false,
  };
  const $ = (id) => document.getElementById(id);

  // Loading

  window.retrogradFeed = function (data) {
    if (data.kind === "index") onIndex(data);
    else onUpdate(data);
  };

  function load(src, onError) {
    const script = document.createElement("script");
    script.src = src + "?t=" + Date.now(); // a fresh copy, not the cached one
    script.onload = () => script.remove();
    script.onerror = () => {
      script.remove();
      if (onError) onError();
    };
    document.head.appendChild(script);
  }

  function updateFile(update) {
    return "feed/update-" + String(update).padStart(6, "0") + ".js";
  }

  function refresh() {
    load("feed/index.js", () => {
      if (!state.index) $("message").textContent = "No feed/index.js yet: waiting for the run.";
    });
  }

  function onIndex(data) {
    const rows = data.updates;
    renderLive(data);
    if (data.generation === state.generation) return;
    state.index = data;
    state.generation = data.generation;
    renderHeader(data.run);
    let row = rows.find((r) => r.update === state.selected);
    if (!row) {
      const wanted = Number(new URLSearchParams(location.hash.slice(1)).get("update"));
      const withTexts = rows.filter((r) => r.texts);
      row = rows.find((r) => r.update === wanted) || withTexts[withTexts.length - 1] || rows[rows.length - 1];
      state.selected = row ? row.update : null;
      state.view = null;
    }
    renderCurves();
    renderList();
    if (!row) {
      $("message").textContent = "No update recorded yet.";
    } else if (!state.view || state.view.rev < row.rev) {
      load(updateFile(row.update));
    }
  }

  function onUpdate(data) {
    if (data.update !== state.selected) return; // an answer to an earlier choice
    const first = !state.view || state.view.update !== data.update;
    state.view = data;
    if (first) state.focus = Number(new URLSearchParams(location.hash.slice(1)).get("group")) || 0;
    renderGroups(first);
  }

  function select(update) {
    if (update === state.selected || update == null) return;
    state.selected = update;
    state.view = null;
    state.focus = 0;
    setHash("#update=" + update);
    renderCurves();
    renderList();
    $("groups").replaceChildren();
    $("update-title").textContent = "update " + update + " (loading)";
    load(updateFile(update));
  }

  function setHash(hash) {
    // The address keeps the place across reloads; a browser that refuses it loses only that.
    try {
      history.replaceState(null, "", hash);
    } catch (e) {
      /* some browsers refuse history on file:// pages */
    }
  }

  // Formatting and elements

  function fmt(v, digits = 4) {
    if (v === null || v === undefined) return "–";
    if (Math.abs(v) >= 1000) return Math.round(v).toLocaleString("en");
    return String(Number(v.toPrecision(digits)));
  }

  function signed(v) {
    return v === null || v === undefined ? "–" : (v > 0 ? "+" : "") + fmt(v, 3);
  }

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v);
    }
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  function svg(tag, attrs, text) {
    const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // The run, the curves and the list of updates

  function renderHeader(run) {
    const segments = run.segments || [];
    const resumed = segments.length > 1 ? " · resumed " + (segments.length - 1) + "×" : "";
    $("run-title").textContent = (run.algorithm || "?") + " · " + (run.model || "?") + resumed;
    $("params-text").textContent = JSON.stringify(run, null, 2);
  }

  function renderLive(data) {
    const times = data.updates.map((r) => r.time || 0).concat(
      (data.run.segments || []).map((s) => s.time || 0));
    const last = Math.max(0, ...times);
    if (!last) return;
    const age = Date.now() / 1000 - last;
    const when = new Date(last * 1000).toLocaleString();
    $("live").textContent = age < 120 ? "live · last record " + Math.round(age) + " s ago" : "last record " + when;
  }

  function renderCurves() {
    const rows = state.index.updates;
    const resumes = (state.index.run.segments || []).slice(1).map((s) => s.resumed_from_update || 0);
    const box = $("curves");
    box.replaceChildren();
    for (const [key, title] of CURVES) {
      const points = rows.filter((r) => r.update != null && typeof r[key] === "number");
      const last = points.length ? points[points.length - 1][key] : null;
      const figure = el("div", { class: "curve", "data-curve": key },
        el("h3", {}, el("span", {}, title), el("span", { class: "muted" }, fmt(last))));
      figure.append(chart(points, key, resumes));
      box.append(figure);
    }
  }

  function chart(points, key, resumes) {
    const W = 300, H = 80, L = 34, R = 4, T = 6, B = 14;
    const root = svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none" });
    const rows = state.index.updates;
    if (!points.length) {
      root.append(svg("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, "no values"));
      return root;
    }
    const u0 = rows[0].update, u1 = Math.max(rows[rows.length - 1].update, u0 + 1);
    let lo = Math.min(...points.map((p) => p[key])), hi = Math.max(...points.map((p) => p[key]));
    if (hi === lo) { lo -= 0.5; hi += 0.5; }
    const x = (u) => L + ((u - u0) / (u1 - u0)) * (W - L - R);
    const y = (v) => T + (1 - (v - lo) / (hi - lo)) * (H - T - B);
    root.append(svg("text", { x: L - 3, y: T + 8, "text-anchor": "end", class: "axis" }, fmt(hi, 3)));
    root.append(svg("text", { x: L - 3, y: H - B, "text-anchor": "end", class: "axis" }, fmt(lo, 3)));
    root.append(svg("text", { x: L, y: H - 2, class: "axis" }, String(u0)));
    root.append(svg("text", { x: W - R, y: H - 2, "text-anchor": "end", class: "axis" }, String(u1)));
    for (const u of resumes) root.append(svg("line", { x1: x(u), x2: x(u), y1: T, y2: H - B, class: "resume" }));
    if (state.selected != null) {
      const sx = x(state.selected);
      root.append(svg("line", { x1: sx, x2: sx, y1: T, y2: H - B, class: "selected" }));
    }
    const path = points.map((p) => x(p.update).toFixed(1) + "," + y(p[key]).toFixed(1)).join(" ");
    root.append(svg("polyline", { points: path, class: "line" }));
    if (points.length <= 60) {
      for (const p of points) root.append(svg("circle", { cx: x(p.update), cy: y(p[key]), r: 1.8, class: "dot" }));
    }
    root.addEventListener("click", (event) => {
      const box = root.getBoundingClientRect();
      const u = u0 + ((event.clientX - box.left) / box.width * W - L) / (W - L - R) * (u1 - u0);
      const nearest = rows.reduce((a, b) => (Math.abs(b.update - u) < Math.abs(a.update - u) ? b : a));
      select(nearest.update);
    });
    return root;
  }

  function renderList() {
    const body = $("updates").querySelector("tbody");
    body.replaceChildren();
    for (const r of state.index.updates.slice().reverse()) {
      const cls = (r.update === state.selected ? "selected " : "") + (r.texts ? "" : "notexts");
      body.append(el("tr", { class: cls, "data-update": r.update, onclick: () => select(r.update) },
        el("td", {}, r.update), el("td", {}, r.status || "running"), el("td", {}, fmt(r.reward, 3)),
        el("td", {}, fmt(r.trained, 3)), el("td", {}, fmt(r.length, 4)), el("td", {}, fmt(r.kl, 3))));
    }
  }

  // One update: its groups and members

  function passes(m) {
    switch (state.filter) {
      case "trained": return m.trained === true;
      case "untrained": return m.trained !== true;
      case "skipped": return m.skip_reason != null;
      case "truncated": return m.truncated === true;
      default: return true;
    }
  }

  function byReward(a, b) {
    const ra = a == null ? -Infinity : a, rb = b == null ? -Infinity : b;
    return rb - ra;
  }

  function groupReward(g) {
    const rewards = g.members.map((m) => m.reward).filter((r) => r != null);
    return rewards.length ? rewards.reduce((a, b) => a + b, 0) / rewards.length : null;
  }

  function renderGroups(scroll) {
    const view = state.view;
    const row = state.index.updates.find((r) => r.update === view.update) || {};
    $("update-title").textContent = "update " + view.update + " · " + (view.status || "running") +
      " · " + view.groups.length + " groups";
    $("message").textContent = row.texts ? "" :
      "Texts are not recorded for this update ([observe].every): rewards and advantages only.";
    const groups = view.groups
      .map((g) => ({ ...g, mean: groupReward(g), shown: g.members.filter(passes) }))
      .filter((g) => g.shown.length)
      .sort((a, b) => byReward(a.mean, b.mean));
    const box = $("groups");
    box.classList.toggle("side-by-side", state.sideBySide);
    box.replaceChildren(...groups.map((g) => renderGroup(g, view.prompts[g.prompt])));
    if (!groups.length && view.groups.length) $("message").textContent = "No member matches the filter.";
    focusGroup(Math.min(state.focus, Math.max(groups.length - 1, 0)), scroll && state.focus > 0);
  }

  function renderGroup(g, messages) {
    const trained = g.members.filter((m) => m.trained === true).length;
    const head = el("h2", {},
      el("span", {}, "group " + g.group),
      el("span", { class: "muted" }, "mean reward " + fmt(g.mean, 3)),
      el("span", { class: "muted" }, trained + "/" + g.members.length + " trained"),
      el("span", { class: "muted" }, g.prompt || ""));
    const prompt = el("details", { class: "prompt", open: "" }, el("summary", {}, "prompt"));
    if (messages) {
      for (const m of messages) prompt.append(el("div", { class: "message" },
        el("div", { class: "role" }, m.role || ""), el("pre", { class: "text" }, contentText(m.content))));
    } else {
      prompt.append(el("div", { class: "muted notext" }, "prompt text not recorded"));
    }
    const members = el("div", { class: "members" },
      ...g.shown.slice().sort((a, b) => byReward(a.reward, b.reward)).map(renderMember));
    return el("article", { class: "group", "data-group": g.group }, head, prompt, members);
  }

  function contentText(content) {
    if (typeof content === "string") return content;
    if (Array.isArray(content)) return content.map((p) => (p && p.text) || JSON.stringify(p)).join("\n");
    return content == null ? "" : JSON.stringify(content);
  }

  function renderMember(m) {
    const cls = "member" + (m.trained === true ? " trained" : "") + (m.skip_reason ? " skipped" : "");
    const badges = [];
    if (m.trained === true) badges.push(el("span", { class: "badge trained" }, "trained"));
    else if (m.trained === false) badges.push(el("span", { class: "badge untrained" }, "not trained"));
    else badges.push(el("span", { class: "badge pending" }, "pending"));
    if (m.truncated) badges.push(el("span", { class: "badge truncated" }, "truncated"));
    if (m.skip_reason && !(m.truncated && m.skip_reason === "truncated")) {
      badges.push(el("span", { class: "badge skip" }, m.skip_reason)); // "truncated" said once
    }
    const parts = [];
    if (m.reward_raw != null && m.reward_raw !== m.reward) parts.push("raw " + fmt(m.reward_raw, 3));
    if (m.judge_term != null) parts.push("judge " + fmt(m.judge_term, 3));
    if (m.turns != null) {
      parts.push(m.turns + " turns · " + m.tool_calls + " calls" +
        (m.tool_errors ? " (" + m.tool_errors + " failed)" : ""));
      if (m.finish) parts.push(m.finish);
      if (m.step_rewards && m.step_rewards.length) {
        parts.push("steps " + m.step_rewards.map((x) => fmt(x, 2)).join(" "));
      }
    }
    const head = el("div", { class: "member-head" },
      el("span", {}, "#" + m.member),
      el("span", { class: "reward" }, "reward " + fmt(m.reward, 3)),
      el("span", {}, "advantage " + signed(m.advantage)),
      el("span", { class: "muted" }, m.tokens + " tokens"),
      parts.length ? el("span", { class: "muted" }, parts.join(" · ")) : null,
      ...badges);
    const conversation = (msgs) => el("div", { class: "conversation" }, ...msgs.map((x) =>
      el("pre", { class: "text msg " + x.role },
        x.role + (x.name ? " " + x.name : "") + (x.is_error ? " (error)" : "") + ": " +
        (x.content || "") +
        (x.tool_calls ? "\n" + x.tool_calls.map((c) => "-> " + c.function.name + " " +
          JSON.stringify(c.function.arguments)).join("\n") : ""))));
    const text = m.messages != null ? conversation(m.messages)
      : m.completion == null
        ? el("div", { class: "muted notext" }, "text not recorded")
        : el("pre", { class: "text" }, m.completion);
    return el("div", { class: cls, "data-member": m.member }, head, text);
  }

  // Keyboard

  function focusGroup(i, scroll) {
    const groups = $("groups").querySelectorAll(".group");
    groups.forEach((g) => g.classList.remove("focus"));
    if (!groups.length) return;
    state.focus = Math.max(0, Math.min(i, groups.length - 1));
    const node = groups[state.focus];
    node.classList.add("focus");
    setHash("#update=" + state.selected + "&group=" + state.focus);
    if (scroll) node.scrollIntoView({ block: "start" });
  }

  function stepUpdate(delta) {
    const rows = state.index ? state.index.updates : [];
    const i = rows.findIndex((r) => r.update === state.selected);
    const next = rows[Math.max(0, Math.min(rows.length - 1, i + delta))];
    if (next) select(next.update);
  }

  document.addEventListener("keydown", (event) => {
    const typing = event.target instanceof Element && event.target.closest("input, select, textarea");
    if (typing || event.ctrlKey || event.metaKey || event.altKey) return;
    const actions = {
      j: () => focusGroup(state.focus + 1, true), ArrowDown: () => focusGroup(state.focus + 1, true),
      k: () => focusGroup(state.focus - 1, true), ArrowUp: () => focusGroup(state.focus - 1, true),
      ArrowLeft: () => stepUpdate(-1), ArrowRight: () => stepUpdate(1),
    };
    if (actions[event.key]) {
      event.preventDefault();
      actions[event.key]();
    }
  });

  $("filter").addEventListener("change", (event) => {
    state.filter = event.target.value;
    if (state.view) renderGroups(false);
  });
  $("side-by-side").addEventListener("change", (event) => {
    state.sideBySide = event.target.checked;
    $("groups").classList.toggle("side-by-side", state.sideBySide);
  });

  refresh();
  setInterval(refresh, REFRESH_MS);
})();
