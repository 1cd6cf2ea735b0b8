"""The Markdown quality table the quality scripts print (``gptq_fp8_quality.py``,
``gguf_imatrix_quality.py``): one row per evaluated output of a ``quantize eval`` report."""
from __future__ import annotations


def print_table(rep, names: list[str], bpw: dict[str, float], times: dict[str, float],
                first: str = "model") -> None:
    """``rep``: :class:`quantpress.targets.eval.EvalReport` whose models are the base then
    ``names`` in order; ``bpw`` / ``times`` (seconds) by name. Prints the FP16 row, then bits
    per weight, PPL, ΔPPL, KL divergence mean / 99th percentile, top-1 agreement and time."""
    base = rep.models[0].ppl["ppl"]
    print(f"| {first} | bpw | PPL | ΔPPL | KLD mean | KLD 99% | top-1 | time |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| FP16 | 16 | {base:.4f} | | | | | |")
    for name, m in zip(names, rep.models[1:]):
        p = m.ppl["ppl"]
        print(f"| {name} | {bpw[name]:.2f} | {p:.4f} | {p - base:+.4f} | {m.kl['kld_mean']:.5f} "
              f"| {m.kl['kld_p99']:.4f} | {100 * m.kl['same_top']:.2f}% | {times[name]:.0f} s |")
