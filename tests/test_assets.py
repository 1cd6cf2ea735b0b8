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
