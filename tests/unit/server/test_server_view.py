"""`retrograd-server view`: an observe directory's viewer over loopback, read-only."""

from __future__ import annotations

import subprocess
import sys

import httpx

from retrograd.cli.run_server import main


def test_view_serves_the_viewer_read_only_on_loopback(tmp_path, capsys):
    (tmp_path / "index.html").write_text("<html>viewer</html>")
    (tmp_path / "feed").mkdir()
    (tmp_path / "feed" / "index.json").write_text('{"updates": []}')
    proc = subprocess.Popen(
        [sys.executable, "-m", "retrograd.cli.run_server", "view", str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        url = line.split(" at ")[1].split()[0]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/index.html")
        assert httpx.get(url).text == "<html>viewer</html>"
        assert httpx.get(url.replace("index.html", "feed/index.json")).json() == {"updates": []}
        assert httpx.post(url).status_code == 405
        # the viewer has no token: a web page may not read it by rebinding its own name to
        # 127.0.0.1, nor from its origin (a script of this machine sends neither header)
        port = url.split(":")[2].split("/")[0]
        assert httpx.get(url, headers={"Host": f"localhost:{port}"}).status_code == 200
        assert httpx.get(url, headers={"Host": f"evil.example:{port}"}).status_code == 403
        assert httpx.get(url, headers={"Origin": "https://evil.example"}).status_code == 403
    finally:
        proc.terminate()
        proc.wait(timeout=30)

    assert main(["view", str(tmp_path), "--bind", "0.0.0.0:0"]) == 1
    assert "loopback address only" in capsys.readouterr().err
    assert main(["view", str(tmp_path / "feed")]) == 1
    assert "not an [observe] directory" in capsys.readouterr().err
