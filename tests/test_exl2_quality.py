"""scripts/exl2_quality.py end to end on a 2-layer random llama (hidden 256, ffn 768, the
SmolLM2 tokenizer): measurement, our Q4_K_M GGUF, EXL2 at two targets and at the GGUF's
decoder bpw, ``quantize eval``, the table and its checks.

This is a test of the script and of its bpw bookkeeping, not of quality: the quality claims
(KL divergence falls from 3.0 to 6.0 bpw on SmolLM2-135M, EXL2 beats Q4_K_M at its decoder
bpw) need the SmolLM2 measurement, about 23 minutes on 2 CPU cores, so they are a script
result (README), not a CI test. On a random model the EXL2-vs-GGUF check may go either way;
what is asserted is that the script reports it consistently with the evaluation's numbers.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINEARS = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
           "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


@pytest.fixture(scope="module")
def run(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("exl2_quality")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(REPO / "scripts" / "exl2_quality.py"), "--model",
                        str(tiny_llama_dir), "--targets", "3.0,6.0", "--samples", "4", "--seqlen",
                        "64", "--chunks", "4", "--ctx", "64", "--out", str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode in (0, 1), p.stderr[-3000:]
    return out, p


def _gguf_decoder_bpw(path: Path) -> float:
    """Decoder bpw of a GGUF from the ggml block sizes (not from the file's byte offsets):
    Σ numel / block_size · type_size · 8 over the decoder layers' linear weights / Σ numel."""
    from gguf import GGML_QUANT_SIZES, GGUFReader

    bits = numel = 0
    for t in GGUFReader(str(path)).tensors:
        parts = t.name.split(".", 2)
        if parts[0] == "blk" and parts[2] in LINEARS:
            n = math.prod(int(d) for d in t.shape)
            block, size = GGML_QUANT_SIZES[t.tensor_type]
            bits += n // block * size * 8
            numel += n
    return bits / numel


def test_outputs_and_bpw_bookkeeping(run, tiny_llama_dir):
    out, p = run
    gguf = out / f"{tiny_llama_dir.name}-Q4_K_M.gguf"
    assert gguf.is_file() and (out / "measurement.json").is_file()
    g_bpw = _gguf_decoder_bpw(gguf)
    assert 4.5 < g_bpw < 6.0                    # Q4_K / Q6_K mix with the 256-wide rows
    g_target = math.floor(g_bpw * 1e4) / 1e4
    table = (out / "table.md").read_text()
    assert table in p.stdout
    summaries = {}
    for t in (3.0, 6.0, g_target):
        s = json.loads((out / f"exl2-content-{t:g}bpw.summary.json").read_text())
        assert s["target_bpw"] == t and s["objective"] == "content"
        assert t - 0.25 <= s["decoder_bpw"] <= t        # 2 layers: coarse choices
        assert s["roundtrip"].startswith("ok")
        summaries[t] = s
        row = next(line for line in table.splitlines() if line.startswith(f"| EXL2 | content | {t:g} |"))
        assert f"| {s['decoder_bpw']:.4f} | {s['file_bpw']:.3f} |" in row
    grow = next(line for line in table.splitlines() if line.startswith("| GGUF Q4_K_M |"))
    assert f"| {g_bpw:.4f} |" in grow


def test_table_and_checks_match_the_evaluation(run, tiny_llama_dir):
    out, p = run
    ev = json.loads((out / "eval.json").read_text())
    models = {Path(m["path"]).name: m for m in ev["models"][1:]}
    assert ev["n_ctx"] == 64 and ev["n_chunks"] == 4
    assert set(models) == {"exl2-content-3bpw", "exl2-content-6bpw",
                           f"{tiny_llama_dir.name}-Q4_K_M.gguf"} | {
        n for n in models if re.fullmatch(r"exl2-content-[45]\.\d+bpw", n)}
    assert len(models) == 4
    kl = {n: m["kl"]["kld_mean"] for n, m in models.items()}
    assert kl["exl2-content-6bpw"] < kl["exl2-content-3bpw"]
    assert re.search(r"check \[content\]: KLD falls as bpw rises over .*: yes", p.stdout)
    g_name = f"{tiny_llama_dir.name}-Q4_K_M.gguf"
    at_g = next(n for n in models if re.fullmatch(r"exl2-content-[45]\.\d+bpw", n))
    verdict = "yes" if kl[at_g] < kl[g_name] else "NO"
    assert f"than GGUF Q4_K_M: {verdict} ({kl[at_g]:.5f} vs {kl[g_name]:.5f})" in p.stdout
    assert p.returncode == (0 if verdict == "yes" else 1)
    for n, m in models.items():
        row = next(line for line in (out / "table.md").read_text().splitlines()
                   if f"| {m['ppl']:.4f} | {m['kl']['kld_mean']:.5f} |" in line)
        assert ("GGUF" in row) == n.endswith(".gguf")
