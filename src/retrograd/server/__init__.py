"""retrograd-server: runs over HTTP (formats.md §9; docs/server.md).

config.py reads the server's TOML. app.py builds the FastAPI app and its discovery routes;
routes_runs.py (create, list, control, ask a live run), routes_events.py (SSE, metrics),
routes_artifacts.py (artifacts, signed links, checkpoints, trajectories) and
routes_datasets.py add theirs; openai_routes.py the OpenAI routes; ui.py the web page (web/: plain
HTML, ES modules and CSS, one module a view under web/features/). documents.py turns a client's
run document into a run; store.py keeps run.json and events.jsonl; runner.py starts and
commands the runs' processes, each one child.py running the loop of `retrograd train`;
events.py delivers live events; guard.py and problems.py are auth, limits and problem+json;
datasets.py, trajectories.py, links.py, model_files.py and view.py own what their names say.
Nothing imported by `retrograd-server --help`, `openapi` or `config-schema` pulls in torch:
runs train in their own processes, and the server loads a model only to answer a chat.
"""
