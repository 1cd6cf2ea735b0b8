"""The SmolLM2 runs several test modules share (session fixtures in conftest.py): the EXL2
measurement (cached in the data cache by a content key), scripts/exl2_quality.py's outputs,
the AWQ / round-to-nearest pair, all with the same calibration (4 rows of 128 tokens, CPU), so
that ``quantize batch`` on SmolLM2 (tests/test_batch_smollm2.py) can be compared with them
without making them twice."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import quantpress
from quantpress import assets

REPO = Path(__file__).resolve().parent.parent
PACKAGE = Path(quantpress.__file__).resolve().parent
DEVICE = "cpu"
#: the decoder-layer linear weights of a llama GGUF (what EXL2's bpw budgets)
LINEARS = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
           "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")

ROWS, SEQLEN = 4, 128          # calibration (measurement and quantization)
CHUNKS, CTX = 4, 256           # evaluation on the held-out split
TARGETS = (3.0, 4.0, 5.0, 6.0)


def _key(model: Path) -> str:
    """Everything the measurement depends on: the calibration shape, the device, the torch and
    transformers versions, every file of the quantpress package and of the model."""
    import torch
    import transformers

    h = hashlib.sha256(f"{ROWS}x{SEQLEN} {DEVICE} torch {torch.__version__} transformers "
                       f"{transformers.__version__}".encode())
    files = sorted(p for p in PACKAGE.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    files += sorted(p for p in model.iterdir() if p.is_file())
    for p in files:
        h.update(str(p.relative_to(p.parent.parent)).encode())
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()[:20]


def measurement(smollm2_dir: Path) -> Path:
    """SmolLM2's measurement.json by this checkout's code (cached by content key)."""
    path = assets.cache_root() / "exl2-measurements" / f"smollm2-{ROWS}x{SEQLEN}-{_key(smollm2_dir)}.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        p = subprocess.run([sys.executable, "-m", "quantpress", "exl2", str(smollm2_dir),
                            "--measure-only", str(path), "--samples", str(ROWS), "--seqlen",
                            str(SEQLEN), "--device", DEVICE, "--quiet"],
                           cwd=REPO, capture_output=True, text=True, timeout=1800)
        assert p.returncode == 0, p.stderr[-3000:]
    return path


def quality(measurement: Path, smollm2_dir: Path, out: Path):
    """scripts/exl2_quality.py with ``measurement`` into ``out``: (process, KLD by output path,
    {target bpw: (directory, summary)}, the GGUF, eval.json, out)."""
    out = out.resolve()
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "exl2_quality.py"), "--model",
                        str(smollm2_dir), "--measurement", str(measurement), "--targets",
                        ",".join(map(str, TARGETS)), "--samples", str(ROWS), "--seqlen",
                        str(SEQLEN), "--chunks", str(CHUNKS), "--ctx", str(CTX), "--out", str(out),
                        "--device", DEVICE],
                       cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=2400)
    assert p.returncode in (0, 1), p.stderr[-3000:]
    ev = json.loads((out / "eval.json").read_text())
    kld = {m["path"]: m["kl"]["kld_mean"] for m in ev["models"][1:]}
    summaries = {}
    for f in out.glob("exl2-*.summary.json"):
        s = json.loads(f.read_text())
        summaries[float(s["details"]["target_bpw"])] = (str(out / f.name.removesuffix(".summary.json")), s)
    gguf = next(out.glob("*.gguf"))
    return p, kld, summaries, gguf, ev, out



def awq_pair(smollm2_dir: Path, root: Path):
    """``quantize awq --group-size 64`` with the shared calibration and its ``--rtn`` baseline,
    into ``root``: their summaries."""
    import make

    a = make.awq(smollm2_dir, root / "awq-g64", group_size=64, samples=ROWS, seqlen=SEQLEN)
    r = make.awq(smollm2_dir, root / "rtn-g64", group_size=64, rtn=True)
    return a, r
