// Pause, resume and cancel: the buttons a run's status allows, shared by the table and a run's page.

import { api } from "../lib/api.js";
import { button, describeError } from "../lib/dom.js";
import { TERMINAL } from "../lib/format.js";

const ACTIONS = [
  { name: "pause", when: ["running", "starting"] },
  { name: "resume", when: ["paused", "pausing", "interrupted"] },
  { name: "cancel", when: ["queued", "starting", "running", "paused", "pausing", "interrupted"] },
];

// Buttons for `run`; `after(answer)` runs once the server accepted, `failed(error)` otherwise.
export function controls(run, after, failed) {
  if (TERMINAL.includes(run.status)) return [];
  return ACTIONS.filter((action) => action.when.includes(run.status)).map((action) =>
    button(
      action.name[0].toUpperCase() + action.name.slice(1),
      async (event) => {
        event.currentTarget.disabled = true;
        try {
          const json = action.name === "cancel" ? { at: "boundary", checkpoint: false } : undefined;
          after(await api(`/runs/${encodeURIComponent(run.id)}/${action.name}`, { method: "POST", json }));
        } catch (error) {
          failed(describeError(error));
        }
      },
      { class: `action-${action.name}`, "data-action": action.name },
    ),
  );
}
