// The page: what the server offers (/v1/capabilities), the login screen when it asks for a
// token, and a view per address (#/runs, #/runs/ID, #/plan, #/datasets, #/compare, ...).

import { api, forgetToken, onUnauthorized } from "./lib/api.js";
import { button, fill, h } from "./lib/dom.js";
import { login } from "./features/login.js";

const VIEWS = {
  runs: { title: "Runs", load: () => import("./features/runs.js") },
  plan: { title: "New run", load: () => import("./features/plan.js") },
  datasets: { title: "Datasets", load: () => import("./features/datasets.js") },
  compare: { title: "Compare", load: () => import("./features/compare.js"), needs: "serving_enabled" },
};

const main = document.getElementById("main");
let features = null;
let leave = null; // the current view's cleanup (streams, timers)
let shown = 0; // which navigation is current: a slow import must not draw over a newer view

// "#/runs/ID/rollouts?x=1" -> {parts: ["runs", "ID", "rollouts"], query: URLSearchParams}
function address() {
  const [path, query] = location.hash.replace(/^#\/?/, "").split("?");
  return { parts: path.split("/").filter(Boolean).map(decodeURIComponent), query: new URLSearchParams(query || "") };
}

function drawNav(parts) {
  const links = Object.entries(VIEWS)
    .filter(([, view]) => !view.needs || features[view.needs])
    .map(([name, view]) => h("a", { href: `#/${name}`, class: parts[0] === name ? "current" : null }, view.title));
  fill(document.getElementById("nav"), links);
  const who = document.getElementById("who");
  fill(who, features.auth ? button("Sign out", () => { forgetToken(); start(); }, { class: "link" }) : null);
}

async function route() {
  if (!features) return;
  const ticket = ++shown;
  if (leave) leave();
  leave = null;
  const { parts, query } = address();
  if (!parts.length) parts.push("runs");
  drawNav(parts);
  let module;
  if (parts[0] === "runs" && parts[1]) {
    module = parts[2] === "rollouts" ? await import("./features/rollouts.js") : await import("./features/run.js");
  } else if (VIEWS[parts[0]] && (!VIEWS[parts[0]].needs || features[VIEWS[parts[0]].needs])) {
    module = await VIEWS[parts[0]].load();
  } else {
    fill(main, h("p", {}, "Nothing here. ", h("a", { href: "#/runs" }, "See the runs.")));
    return;
  }
  if (ticket !== shown) return;
  fill(main);
  const view = h("section", { class: "view" });
  main.append(view);
  leave = module.render(view, { parts, query, features }) || null;
}

async function start() {
  features = null;
  if (leave) leave();
  leave = null;
  try {
    features = (await api("/capabilities")).features;
  } catch (error) {
    if (error.status === 401) {
      fill(document.getElementById("nav"));
      fill(document.getElementById("who"));
      fill(main, login(start));
      return;
    }
    fill(main, h("p", { class: "error" }, `The server did not answer: ${error.message}`));
    return;
  }
  route();
}

onUnauthorized(() => {
  if (features) start();
});
window.addEventListener("hashchange", route);
start();
