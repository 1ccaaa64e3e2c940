"""GET /v1/model-files lists what the path roots hold: one odd file there (an array for its
architecture, a FIFO named like a model, a name of a megabyte) is left out or shortened, and
never fails or hangs the listing of the others."""

from __future__ import annotations

import os
import threading

import gguf
import numpy as np

from retrograd.server.model_files import MAX_NAME_CHARS, ModelFiles
from tests.factories.tiny_gguf import write_tiny


def _odd(path, architecture, name="odd"):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(name)
    if architecture is not None:  # replaces general.architecture as the reader sees it
        w.kv_data[0].pop("general.architecture")
        w.add_array("general.architecture", architecture)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_one_odd_file_does_not_fail_or_hang_the_listing(tmp_path):
    good = write_tiny(tmp_path / "good.gguf", "llama")
    _odd(tmp_path / "array-arch.gguf", ["llama", "qwen3"])
    _odd(tmp_path / "long-name.gguf", None, name="n" * 1_000_000)
    os.mkfifo(tmp_path / "fifo.gguf")  # opening it would wait for a writer forever
    out: list = []
    scan = threading.Thread(target=lambda: out.append(ModelFiles([tmp_path]).listing()))
    scan.start()
    scan.join(timeout=30)
    assert not scan.is_alive(), "the listing waited on the FIFO"
    (files,) = out
    by_path = {f["path"]: f for f in files}
    assert set(by_path) == {str(good), str(tmp_path / "long-name.gguf")}
    assert by_path[str(good)]["role"] == "model"
    assert len(by_path[str(tmp_path / "long-name.gguf")]["name"]) == MAX_NAME_CHARS
