"""Who reaches what on a server with a token: without it nothing under /v1 but the one
artifact a signed link names, while the link lasts; the page's static files are public.

A table of near-miss queries (each a way a careless check of `sig` could be fooled) is sent
without the token to a real app over ASGI: only a query that is exactly the link's `sig` and
`exp`, verified for that run, that artifact and that expiry, downloads. An unknown run answers
401 like a known one, so that a stranger learns nothing of which runs exist.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from retrograd.server.app import create_app
from retrograd.server.config import load_server_config
from retrograd.server.store import RunRecord, now_ms

TOKEN = "s3cret-token"
RUN, OTHER = "run_00000000000a1b2c3", "run_00000000000d4e5f6"


def _record(run_id: str, adapter) -> RunRecord:
    return RunRecord(
        id=run_id,
        name=None,
        status="completed",
        algorithm="sft",
        model="m.gguf",
        created_at=now_ms(),
        effective_config={"output": {"path": str(adapter), "kind": "adapter"}},
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    config = load_server_config(
        overrides={"state_dir": str(tmp / "state"), "auth_token": TOKEN}, environ={}
    )
    app = create_app(config)
    with TestClient(app, raise_server_exceptions=False) as client:
        store = app.state.store
        for run_id in (RUN, OTHER):
            adapter = tmp / f"{run_id}.gguf"
            adapter.write_bytes(b"GGUF adapter of " + run_id.encode())
            with store.lock:
                store.add(_record(run_id, adapter))
                store.logs[run_id].append("status", {"status": "completed"})
        yield app, client


def link(app, run_id: str, name: str, ttl: int | None = None) -> tuple[str, int]:
    links = app.state.links
    kept = links.ttl
    links.ttl = ttl if ttl is not None else kept
    try:
        return links.sign(run_id, name)
    finally:
        links.ttl = kept


def _near_misses(app) -> list[tuple[str, str, str]]:
    """(why, path, query) that must all answer 401 without the token."""
    sig, exp = link(app, RUN, "run")
    other_run, _ = link(app, OTHER, "run")
    other_name, other_exp = link(app, RUN, "events")
    old_sig, old_exp = link(app, RUN, "run", ttl=-5)
    run = f"/v1/runs/{RUN}/artifacts/run"
    return [
        ("no query", run, ""),
        ("a parameter merely containing sig=", run, "xsig=1"),
        ("another name ending in sig", run, f"xsig={sig}&exp={exp}"),
        ("an empty sig", run, "sig="),
        ("an empty sig and exp", run, "sig=&exp="),
        ("a sig without exp", run, f"sig={sig}"),
        ("an exp without sig", run, f"exp={exp}"),
        ("a made-up sig", run, f"sig={'0' * 64}&exp={exp}"),
        (
            "the sig with one digit changed",
            run,
            f"sig={sig[:-1]}{'0' if sig[-1] != '0' else '1'}&exp={exp}",
        ),
        ("the expiry moved later", run, f"sig={sig}&exp={exp + 3600}"),
        ("the expiry with a leading zero", run, f"sig={sig}&exp=0{exp}"),
        ("the expiry with a plus", run, f"sig={sig}&exp=%2B{exp}"),
        ("a negative expiry", run, f"sig={sig}&exp=-{exp}"),
        ("an expiry of non-ASCII digits", run, f"sig={sig}&exp=%C2%B2"),
        ("an expiry too large for any clock", run, f"sig={sig}&exp={'9' * 40}"),
        ("a non-ASCII sig", run, f"sig=%C3%A9&exp={exp}"),
        ("an expired link", run, f"sig={old_sig}&exp={old_exp}"),
        ("the sig of another run", run, f"sig={other_run}&exp={exp}"),
        ("the sig of another artifact", run, f"sig={other_name}&exp={other_exp}"),
        ("the link on another run", f"/v1/runs/{OTHER}/artifacts/run", f"sig={sig}&exp={exp}"),
        (
            "the link on another artifact",
            f"/v1/runs/{RUN}/artifacts/events",
            f"sig={sig}&exp={exp}",
        ),
        ("the link on the run itself", f"/v1/runs/{RUN}", f"sig={sig}&exp={exp}"),
        ("the link on the artifact listing", f"/v1/runs/{RUN}/artifacts", f"sig={sig}&exp={exp}"),
        ("the link on a trailing slash", run + "/", f"sig={sig}&exp={exp}"),
        ("sig twice, the good one last", run, f"sig=0&sig={sig}&exp={exp}"),
        ("sig twice, the good one first", run, f"sig={sig}&sig=0&exp={exp}"),
        ("the same sig twice", run, f"sig={sig}&sig={sig}&exp={exp}"),
        ("exp twice", run, f"sig={sig}&exp={exp}&exp={exp}"),
        ("another parameter beside the link", run, f"sig={sig}&exp={exp}&x=1"),
        ("upper-case names", run, f"SIG={sig}&EXP={exp}"),
        ("an upper-case sig", run, f"sig={sig.upper()}&exp={exp}"),
        ("a ; separator", run, f"sig={sig};exp={exp}"),
        ("an encoded & inside sig", run, f"sig={sig}%26exp={exp}"),
        ("an encoded # inside sig", run, f"sig={sig}%23&exp={exp}"),
        ("an encoded = in the name", run, f"sig%3D{sig}&exp={exp}"),
        ("a space after sig", run, f"sig={sig}+&exp={exp}"),
        ("a null byte in sig", run, f"sig={sig}%00&exp={exp}"),
        ("a percent-encoded name with a made-up sig", run, f"%73ig={'0' * 64}&exp={exp}"),
        ("an unknown run, a made-up sig", "/v1/runs/run_0000000000ffffff/artifacts/run", "xsig=1"),
        (
            "an unknown run, another run's sig",
            "/v1/runs/run_0000000000ffffff/artifacts/run",
            f"sig={sig}&exp={exp}",
        ),
    ]


def test_near_miss_queries_need_the_token(server):
    app, client = server
    wrong = []
    for why, path, query in _near_misses(app):
        r = client.get(path + ("?" + query if query else ""))
        if r.status_code != 401:
            wrong.append(f"{why}: {r.status_code}")
            continue
        assert r.headers["content-type"] == "application/problem+json"
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert r.json()["type"].endswith("/unauthorized")
    assert not wrong, wrong


def test_a_signed_link_downloads_its_artifact_and_only_that(server):
    app, client = server
    for name, expected in (("run", None), ("events", None), ("adapter", b"GGUF adapter of ")):
        sig, exp = link(app, RUN, name)
        r = client.get(f"/v1/runs/{RUN}/artifacts/{name}?sig={sig}&exp={exp}")
        assert r.status_code == 200, (name, r.text)
        if name == "run":
            assert json.loads(r.content)["id"] == RUN
        elif name == "events":
            assert json.loads(r.content.splitlines()[0])["type"] == "status"
        else:
            assert r.content == expected + RUN.encode()
    # the same link however the URL spells it: the query decoded as the route decodes it
    sig, exp = link(app, RUN, "run")
    for query in (
        f"%73ig={sig}&exp={exp}",
        f"exp={exp}&sig={sig}",
        f"sig=%{ord(sig[0]):02x}{sig[1:]}&exp={exp}",
    ):
        assert client.get(f"/v1/runs/{RUN}/artifacts/run?{query}").status_code == 200, query
    assert client.get(f"/v1/runs/{RUN}/artifacts/%72un?sig={sig}&exp={exp}").status_code == 200
    assert client.head(f"/v1/runs/{RUN}/artifacts/run?sig={sig}&exp={exp}").status_code == 401


def test_the_token_opens_everything_and_an_unknown_run_is_then_404(server):
    _, client = server
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    assert client.get(f"/v1/runs/{RUN}/artifacts/run", headers=bearer).status_code == 200
    # with the token a stray sig is no reason to refuse
    assert client.get(f"/v1/runs/{RUN}/artifacts/run?sig=0", headers=bearer).status_code == 200
    r = client.get("/v1/runs/run_0000000000ffffff/artifacts/run", headers=bearer)
    assert r.status_code == 404
    r = client.get("/v1/runs/run_0000000000ffffff/artifacts/run")
    assert r.status_code == 401  # without it: the same answer as for a run that exists


@pytest.mark.parametrize(
    "header",
    [
        b"Bearer \xe9",
        b"Bearer " + TOKEN.encode() + b"\xe9",
        b"bearer",
        b"Basic " + TOKEN.encode(),
        b"Bearer",
    ],
)
def test_a_wrong_authorization_header_is_401_never_500(server, header):
    _, client = server
    r = client.get("/v1/runs", headers={"Authorization": header})
    assert r.status_code == 401 and r.json()["type"].endswith("/unauthorized")


def test_every_route_under_v1_needs_the_token_and_the_page_does_not(server):
    app, client = server
    routes = [(m.upper(), p) for p, item in app.openapi()["paths"].items() for m in item]
    routes += [("POST", "/v1/chat/completions"), ("GET", "/v1/openapi.json")]  # not in it
    assert len(routes) > 40 and all(p.startswith("/v1/") for _, p in routes)
    for method, path in routes:
        path = path.replace("{run_id}", RUN).replace("{model_id}", f"{RUN}@base")
        path = path.replace("{", "").replace("}", "")  # other parameters: any value
        r = client.request(method, path)
        assert r.status_code == 401, (method, path, r.status_code)
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert client.get("/web/app.js").status_code in (200, 404)  # public: never 401
    for path in ("//v1/runs", "/v1/../v1/runs", "/V1/runs", "/%76%31/runs"):
        assert client.get(path).status_code in (401, 404), path


def test_trace_id_is_sent_once_and_equals_the_document(server):
    _, client = server
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    for r in (
        client.get("/v1/runs"),  # refused by the guard
        client.get("/v1/runs/run_0000000000ffffff", headers=bearer),  # raised in the route
        client.get("/v1/runs?limit=0", headers=bearer),  # FastAPI's validation
        client.post(f"/v1/runs/{RUN}/cancel", content=b"[", headers=bearer),  # body not JSON
    ):
        values = r.headers.get_list("trace-id")
        assert len(values) == 1 and values[0] == r.json()["trace_id"], (r.url, values)
    values = client.get("/v1/health", headers=bearer).headers.get_list("trace-id")
    assert len(values) == 1 and len(values[0]) == 32


@pytest.fixture(scope="module")
def tokenless(tmp_path_factory):
    config = load_server_config(
        overrides={"state_dir": str(tmp_path_factory.mktemp("open") / "state")}, environ={}
    )
    with TestClient(create_app(config), base_url="http://127.0.0.1:8471") as client:
        yield client


@pytest.mark.parametrize(
    ("headers", "allowed"),
    [
        ({}, True),  # a script, curl, the SDKs: no Origin
        ({"Host": "localhost:8471"}, True),
        ({"Host": "[::1]:8471"}, True),
        ({"Host": "127.0.0.2"}, True),
        ({"Origin": "http://127.0.0.1:8471"}, True),  # the server's own page
        ({"Origin": "http://localhost:5173"}, True),  # a page of this machine
        ({"Host": "evil.example:8471"}, False),  # DNS rebinding: a site's name, our address
        ({"Host": "127.0.0.1.evil.example"}, False),
        ({"Host": "localhost.evil.example:8471"}, False),
        ({"Origin": "https://evil.example"}, False),  # a page elsewhere, posting to us
        ({"Origin": "null"}, False),  # a sandboxed frame or a file
    ],
)
def test_without_a_token_only_this_machine_is_answered(tokenless, headers, allowed):
    # with no token, a loopback server is open to whoever reaches the port: a web page the
    # browser shows reaches it too, by a cross-site request or by rebinding its own name
    r = tokenless.post(
        "/v1/datasets?name=x", content=b"hello\n", headers=headers | {"Content-Type": "text/plain"}
    )
    if allowed:
        assert r.status_code in (200, 201), r.text
    else:
        assert r.status_code == 401 and "loopback" in r.json()["detail"], r.text
        assert tokenless.get("/v1/runs", headers=headers).status_code == 401
    assert tokenless.get("/", headers=headers).status_code == 200  # the page is public
