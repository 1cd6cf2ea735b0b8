"""AWQ on the real SmolLM2-135M (w4 g64: its width 576 is not a multiple of 128): a real
consumer (transformers 5 + gptqmodel's CPU AWQ kernel) loads the directory and agrees with our
dequantized model, and on held-out text AWQ beats plain round-to-nearest with the same packing.
Few calibration rows and chunks keep it short; scripts/awq_quality.py makes the full table."""
from __future__ import annotations

import json

import make
import pytest
import torch

from quantpress.convert import awq_dir
from quantpress.targets import ComputeOptions
from quantpress.targets.eval import EvalOptions, evaluate

from smollm2_runs import ROWS as SAMPLES, SEQLEN  # 512 calibration tokens (CI time)

EVAL_CHUNKS = 6


@pytest.fixture(scope="module")
def smollm2_awq(smollm2_awq_pair):
    return smollm2_awq_pair


def test_summary_and_layout(smollm2_awq, smollm2_dir):
    a, r = smollm2_awq
    for s in (a, r):
        d = s.details
        assert s.roundtrip.startswith("ok") and d["linears_quantized"] == d["linears"] == 30 * 7
        assert not d["modules_to_not_convert"]
        cfg = json.loads((s.output / "config.json").read_text())
        assert cfg["quantization_config"]["group_size"] == 64 and cfg["tie_word_embeddings"] is True
        # tied embeddings: no lm_head tensor; 4-bit layers + FP16 embeddings ≈ 6.6 bits per weight
        assert "lm_head.weight" not in awq_dir.AWQWeights(s.output).keys()
        assert 5.5 < s.bpw < 7.5
    assert a.details["calibration"] == {"rows": SAMPLES, "seqlen": SEQLEN}
    assert a.details["method"] == "awq"


def test_transformers_gptqmodel_loads_and_agrees(smollm2_awq):
    """transformers 5.23 with gptqmodel 7.7 (CPU AWQ kernel) reads our directory; in float32
    its logits equal those of our dequantized model within 1e-3 (the kernel dequantizes the
    same integers and scales; the rest is float32 summation order)."""
    from transformers import AutoModelForCausalLM

    a, _ = smollm2_awq
    model = AutoModelForCausalLM.from_pretrained(a.output, dtype=torch.float32, device_map="cpu")
    qlin = model.model.layers[0].self_attn.q_proj
    assert "Awq" in type(qlin).__name__, type(qlin)
    ids = torch.randint(0, 49152, (2, 48), generator=torch.Generator().manual_seed(0))
    theirs, ours = make.logits_both(model, awq_dir.streaming_model(a.output, dtype=torch.float32), ids)
    diff = float((theirs - ours).abs().max())
    assert diff < 1e-3, diff
    assert float(ours.abs().max()) > 1.0  # real logits, not zeros


def test_awq_beats_round_to_nearest(smollm2_awq, smollm2_dir):
    """Held-out perplexity and KL divergence from the FP16 model: AWQ below RTN."""
    a, r = smollm2_awq
    res = evaluate(smollm2_dir, [a.output, r.output], EvalOptions(ctx=512, chunks=EVAL_CHUNKS),
                   ComputeOptions(device="cpu"), progress=False)
    base, awq, rtn = res.models
    assert awq.ppl["ppl"] < rtn.ppl["ppl"], (base.ppl, awq.ppl, rtn.ppl)
    assert awq.kl["kld_mean"] < rtn.kl["kld_mean"], (awq.kl, rtn.kl)
    assert base.ppl["ppl"] < awq.ppl["ppl"] and awq.kl["kld_mean"] > 0
