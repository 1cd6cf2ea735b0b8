"""The cache's file locks: a process that finds an entry being filled waits for it and takes
what the filler left, instead of fetching it a second time (parallel test workers, two
commands started together on a fresh machine)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from quantpress import assets


def test_second_process_waits_for_the_entry_being_filled(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTPRESS_CACHE", str(tmp_path))
    out = tmp_path / "ref" / "exllamav2-0.3.2" / "standard_cal_data"
    with assets.cache_lock("standard_cal_data"):
        p = subprocess.Popen([sys.executable, "-m", "quantpress.assets", "cal-data"],
                             env=dict(os.environ, QUANTPRESS_CACHE=str(tmp_path)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(3)                     # it found no entry and waits on the lock
        assert p.poll() is None
        out.mkdir(parents=True)
        (out / "wiki.utf8").write_text("filled by the lock's holder\n")
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 0, stderr
    assert stdout.strip() == str(out)
    assert not (tmp_path / "dl").exists()     # it downloaded nothing
    assert (out / "wiki.utf8").read_text() == "filled by the lock's holder\n"
