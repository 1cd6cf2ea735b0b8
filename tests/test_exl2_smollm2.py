"""EXL2 quality on the real SmolLM2-135M (issue 5, "what it must show" 4), by
scripts/exl2_quality.py: one measurement, EXL2 at 3.0 / 4.0 / 5.0 / 6.0 bpw and at the decoder
bpw of our own Q4_K_M GGUF, ``quantize eval`` on held-out text.

Asserted on the evaluation's own numbers (eval.json and the summaries), not on the script's
verdict alone: KL divergence from the FP16 model falls strictly as the target rises, every
achieved decoder bpw lies in [target − 0.05, target], and at the GGUF's decoder bpw EXL2 has a
lower KL divergence than the GGUF.

The script's bookkeeping is checked against the files themselves: the GGUF's decoder bpw
recomputed from ggml's block sizes, and every table row against the summaries and eval.json.

Cost: the measurement (every option of every module, about 4 minutes here) is cached in the
data cache under a key that covers every file of the quantpress package (the CLI and the
targets included), the torch and transformers versions, the device, the model's files and the
calibration shape, so any change that could change it measures again; the rest
(5 quantizations, the GGUF, the evaluation of 7 models) takes about 5 minutes. The runs are
session fixtures (tests/smollm2_runs.py): tests/test_batch_smollm2.py compares ``quantize
batch`` with them.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from smollm2_runs import LINEARS, TARGETS


@pytest.fixture(scope="module")
def quality(exl2_smollm2_quality):
    return exl2_smollm2_quality


def test_kl_divergence_falls_as_bpw_rises(quality):
    p, kld, summaries, *_ = quality
    assert set(TARGETS) <= set(summaries)
    ks = [kld[summaries[t][0]] for t in TARGETS]
    assert all(b < a for a, b in zip(ks, ks[1:])), ks
    for t, (_, s) in summaries.items():
        d = s["details"]
        assert t - 0.05 <= d["decoder_bpw"] <= t, (t, d["decoder_bpw"])
        assert s["roundtrip"].startswith("ok (211 linears")


def _gguf_decoder_bpw(path: Path) -> float:
    """Decoder bpw of a GGUF from ggml's block sizes (not from the script's byte counts):
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


def test_table_matches_files_summaries_and_evaluation(quality):
    """Every row of the script's table: the summaries' decoder and file bpw, eval.json's PPL and
    KLD; the GGUF row's decoder bpw as ggml's block sizes give it."""
    p, kld, summaries, gguf, ev, out = quality
    table = (out / "table.md").read_text()
    assert table in p.stdout
    by_path = {m["path"]: m for m in ev["models"]}
    for t, (path, s) in summaries.items():
        row = next(line for line in table.splitlines() if line.startswith(f"| EXL2 | content | {t:g} |"))
        m = by_path[path]
        assert (f"| {s['details']['decoder_bpw']:.4f} | {s['bpw']:.3f} | {m['ppl']:.4f} | "
                f"{m['kl']['kld_mean']:.5f} |") in row
    g_bpw = _gguf_decoder_bpw(gguf)
    grow = next(line for line in table.splitlines() if line.startswith("| GGUF Q4_K_M |"))
    assert f"| {g_bpw:.4f} |" in grow and f"| {by_path[str(gguf)]['ppl']:.4f} |" in grow
    assert math.floor(g_bpw * 1e4) / 1e4 in summaries


def test_beats_q4_k_m_at_its_decoder_bpw(quality):
    p, kld, summaries, gguf, *_ = quality
    extra = [t for t in summaries if t not in TARGETS]
    assert len(extra) == 1, summaries.keys()          # the GGUF's decoder bpw, floored
    t = extra[0]
    assert 5.0 < t < 6.0                              # Q4_K_M on SmolLM2 mixes Q5_0 / Q4_K / Q6_K / Q8_0
    assert kld[summaries[t][0]] < kld[str(gguf)], (kld[summaries[t][0]], kld[str(gguf)])
    assert p.returncode == 0, p.stdout[-2000:]        # the script's own checks agree
