"""Bad inputs docs/troubleshooting.md lists that no other test covers:
a folder of the other kind given to a converter, and empty (0-byte) weight shards. Each must be
refused through the real command with one line and exit 2, leaving the input and output as they were."""

import hashlib
import os

import pytest

from mixln_megatron.convert import cli as convert_cli
from mixln_megatron.convert import convert_from_hf as from_hf
from test_convert import make_mixln_folder, no_leftovers

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def digest(folder) -> dict:
    """Every file under `folder` and the hash of its bytes: what 'untouched' means."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def refused(capsys, argv, *expected):
    """Run `mixln-megatron convert ARGV`: exit 2, one line on stderr holding every expected part."""
    capsys.readouterr()  # what building the inputs printed
    assert convert_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for part in expected:
        assert part in err, (part, err)
    return err


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("bad_inputs")
    make_mixln_folder(base / "hf")
    from_hf(str(base / "hf"), str(base / "megatron"), progress=False)
    return base


def test_folder_of_the_other_kind_is_refused(folders, tmp_path, capsys):
    hf, megatron, out = folders / "hf", folders / "megatron", tmp_path / "out"
    before = digest(hf), digest(megatron)
    refused(capsys, ["to-hf", "--load", str(hf), "--save", str(out), "--no-progress"],
            "not a Megatron-LM checkpoint", str(hf))
    refused(capsys, ["from-hf", "--load", str(megatron), "--save", str(out), "--no-progress"],
            "not a Hugging Face model folder", "config.json")
    assert (digest(hf), digest(megatron)) == before
    assert not out.exists() and not no_leftovers(out)


def test_empty_shards_are_refused_naming_the_file(folders, tmp_path, capsys):
    out = tmp_path / "out"
    megatron = tmp_path / "megatron"
    from_hf(str(folders / "hf"), str(megatron), progress=False)
    shard = megatron / "release" / "__0_0.distcp"
    shard.write_bytes(b"")
    refused(capsys, ["to-hf", "--load", str(megatron), "--save", str(out), "--no-progress"],
            "truncated", str(shard))
    hf = tmp_path / "hf"
    make_mixln_folder(hf)
    weights = hf / "model.safetensors"
    weights.write_bytes(b"")
    refused(capsys, ["from-hf", "--load", str(hf), "--save", str(out), "--no-progress"],
            f"weight shard {weights} is unreadable")
    assert not out.exists() and not no_leftovers(out)
