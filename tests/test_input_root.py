"""mixln_megatron.input_root: every file a command opens from its input stays inside it, is a regular
file and is bounded. Real files, links, FIFOs and devices; no mocks."""

from __future__ import annotations

import os
import threading

import pytest

from mixln_megatron.errors import MixLNError, UnsafeInputError
from mixln_megatron.input_root import LIMITS, InputRoot


@pytest.fixture()
def tree(tmp_path):
    """tmp/in (the input: a.json, sub/b.bin, inner link -> a.json) and tmp/secret (outside)."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"SECRET-OUTSIDE")
    root = tmp_path / "in"
    (root / "sub").mkdir(parents=True)
    (root / "a.json").write_text('{"x": 1}')
    (root / "sub" / "b.bin").write_bytes(b"\0" * 10)
    os.symlink("a.json", root / "inner_link")
    os.symlink(str(secret), root / "out_link")
    os.symlink("..", root / "sub" / "up")
    return root, secret


def test_refuses_names_that_leave_the_folder(tree):
    root, secret = tree
    r = InputRoot(str(root), "checkpoint")
    for rel in (str(secret), "../secret", "sub/../../secret", "out_link", "sub/up/out_link", "sub/up/in/../secret"):
        with pytest.raises(UnsafeInputError) as e:
            r.path(rel)
        assert "\n" not in str(e.value)
    for rel in ("", None, 3, "a\x00b"):
        with pytest.raises(UnsafeInputError):
            r.path(rel)
    assert issubclass(UnsafeInputError, MixLNError)


def test_reads_inside_including_inner_links(tree):
    root, _ = tree
    r = InputRoot(str(root))
    assert r.read_json("a.json", "config.json") == {"x": 1}
    assert r.read_json("inner_link", "config.json") == {"x": 1}
    assert r.read_bytes("sub/b.bin", "tracker") == b"\0" * 10
    assert r.is_file("a.json") and not r.is_file("out_link") and not r.is_file("sub")
    assert r.sub("sub").read_bytes("b.bin", "tracker") == b"\0" * 10
    with pytest.raises(UnsafeInputError):
        r.sub("sub").path("../a.json")  # a sub-folder is its own root


def test_a_linked_input_folder_is_the_users_choice(tree, tmp_path):
    root, _ = tree
    os.symlink(str(root), tmp_path / "alias")
    assert InputRoot(str(tmp_path / "alias")).read_json("a.json", "config.json") == {"x": 1}


def test_size_bound_and_type(tree):
    root, _ = tree
    (root / "big.json").write_bytes(b" " * (LIMITS["metadata.json"] + 1))
    r = InputRoot(str(root))
    with pytest.raises(UnsafeInputError, match="more than any real metadata.json"):
        r.read_json("big.json", "metadata.json")
    (root / "list.json").write_text("[1, 2]")
    with pytest.raises(UnsafeInputError, match="JSON array, expected a JSON object"):
        r.read_json("list.json", "config.json")
    (root / "bad.json").write_text("{nope")
    with pytest.raises(UnsafeInputError, match="not valid JSON"):
        r.read_json("bad.json", "config.json")
    with pytest.raises(UnsafeInputError, match="not a regular file"):
        r.read_bytes("sub", "tracker")
    with pytest.raises(UnsafeInputError, match="missing"):
        r.read_bytes("nothing", "tracker")


def test_fifo_and_devices_are_refused_without_blocking(tmp_path):
    root = tmp_path / "in"
    root.mkdir()
    os.mkfifo(root / ".metadata")
    os.symlink("/dev/zero", root / "zero")
    r = InputRoot(str(root))
    outcome = {}

    def attempt():
        for rel in (".metadata", "zero"):
            try:
                r.read_bytes(rel, ".metadata")
            except UnsafeInputError as e:
                outcome[rel] = str(e)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(60)  # a blocking open would hang here: generous, never reached when correct
    assert not worker.is_alive(), "opening a FIFO from the input blocked"
    assert "a FIFO" in outcome[".metadata"]
    assert "outside" in outcome["zero"]  # /dev/zero is outside the folder before it is a device


def test_device_inside_the_folder_is_refused(tmp_path):
    # a device node cannot be made without privileges; /dev itself is the folder here
    r = InputRoot("/dev")
    with pytest.raises(UnsafeInputError, match="character device"):
        r.read_bytes("zero", ".metadata")
