"""retrograd-server: runs over HTTP (formats.md §9).

config.py reads the server's TOML; app.py builds the FastAPI app (discovery) and
routes_runs.py its run routes; documents.py turns a client's run document into a run;
store.py keeps run.json and events.jsonl; runner.py starts and commands the runs' processes
(child.py is such a process); events.py delivers live events; guard.py and problems.py are
auth, limits and problem+json. Nothing imported by `retrograd-server --help`, `openapi` or
`config-schema` pulls in torch: only child.py, in its own process, trains.
"""
