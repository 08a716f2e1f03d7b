"""File hashing for bundles: the pipelined path (a reader thread feeding the hasher, for big
files) gives exactly hashlib's digest, and a big file edited anywhere fails verification."""
from __future__ import annotations

import hashlib
import os

import pytest

from rtxops.governance import Signer, Trust, generate_key, verify
from rtxops.governance import _layout


@pytest.mark.parametrize("size", [
    0, 1, _layout._CHUNK - 1, _layout._PIPELINE_BYTES - 1, _layout._PIPELINE_BYTES,
    _layout._PIPELINE_BYTES + _layout._CHUNK + 7, 3 * _layout._PIPELINE_BYTES + 12345])
def test_digest_equals_hashlib(size, tmp_path):
    data = os.urandom(size)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    assert _layout.sha256_file(path) == hashlib.sha256(data).hexdigest()


def test_unreadable_big_file_raises_not_hangs(tmp_path):
    path = tmp_path / "dir.bin"
    path.mkdir()  # open() of a directory fails before any thread starts
    with pytest.raises(OSError):
        _layout.sha256_file(path)


@pytest.mark.parametrize("where", ["start", "middle", "end", "truncated"])
def test_big_file_edited_anywhere_fails_verification(where, tmp_path):
    key = tmp_path / "key.pem"
    generate_key(key)
    bundle = tmp_path / "ckpt"
    bundle.mkdir()
    size = _layout._PIPELINE_BYTES + 3 * _layout._CHUNK + 5
    (bundle / "model.bin").write_bytes(os.urandom(size))
    Signer.from_key_file(key).sign_directory(bundle, kind="checkpoint")
    trust = Trust(public_key=key.with_suffix(".pub").read_bytes())
    assert verify(bundle, trust).ok

    with open(bundle / "model.bin", "r+b") as f:
        if where == "truncated":
            f.truncate(size - _layout._CHUNK)
        else:
            f.seek({"start": 0, "middle": size // 2, "end": size - 1}[where])
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 1]))
    report = verify(bundle, trust)
    assert not report.ok
    assert any(c.name == "files" and not c.ok and "model.bin" in c.message for c in report.checks)
