#!/usr/bin/env python3
"""Benchmark `convert hf-to-gguf --policy Q4_K_M` against llama.cpp on the same model and
machine: llama.cpp's convert_hf_to_gguf.py --outtype f16 followed by llama-quantize
(llama_model_quantize from llama-cpp-python 0.3.36, the function llama-quantize calls,
with nthread = all cores). Each step runs in its own process; wall time and peak RSS
(ru_maxrss of that process) are measured with os.wait4. Prints both, their ratios, and
whether the two outputs carry identical tensors.

  python scripts/bench_gguf.py                       # SmolLM2-135M
  python scripts/bench_gguf.py --model synth4x       # synthetic llama ~4x SmolLM2's size
  python scripts/bench_gguf.py --device cuda         # our quantization on the GPU
  python scripts/bench_gguf.py --imatrix FILE        # both with importance weights (llama.cpp:
                                                     # the llama-quantize tool, --imatrix FILE)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests"))
import llamacpp_tools  # noqa: E402
from quantpress import assets  # noqa: E402

PY = sys.executable


def measure(cmd: list[str], env: dict | None = None) -> tuple[float, float]:
    """Run ``cmd``; return (wall seconds, peak RSS MiB) of that process."""
    with tempfile.TemporaryFile() as err:  # a pipe would fill up and block the child
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        if os.waitstatus_to_exitcode(status) != 0:
            err.seek(0)
            raise SystemExit(f"failed: {' '.join(cmd)}\n{err.read().decode()[-2000:]}")
    return wall, ru.ru_maxrss / 1024


def synth4x() -> Path:
    """A random llama with ~554M parameters (4.1x SmolLM2), FP16, cached."""
    out = assets.cache_root() / "models" / "synth-llama-554M"
    if (out / "config.json").exists():
        return out
    import synth
    import torch

    tmp = Path(tempfile.mkdtemp(dir=out.parent))
    synth.make_model(tmp, "llama", assets.smollm2_dir(), dtype=torch.float16, hidden_size=1536,
                     intermediate_size=4096, num_hidden_layers=16, num_attention_heads=12,
                     num_key_value_heads=4, max_shard_size="400MB")
    tmp.chmod(0o755)
    tmp.rename(out)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2, synth4x, or a model directory")
    ap.add_argument("--policy", default="Q4_K_M")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--imatrix", help="an imatrix file for both quantizers (quantize imatrix's or llama-imatrix's)")
    args = ap.parse_args()
    model = {"smollm2": assets.smollm2_dir, "synth4x": synth4x}.get(args.model, lambda: Path(args.model))()
    src = llamacpp_tools.llamacpp_src()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    nthread = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        ref_f16, ref_q, ours, ours_q = d / "ref-f16.gguf", d / "ref-q.gguf", d / "ours.gguf", d / "ours-q.gguf"
        conv = measure([PY, str(src / "convert_hf_to_gguf.py"), str(model), "--outtype", "f16",
                        "--outfile", str(ref_f16)], env)
        quant_code = ("import ctypes,sys,llama_cpp as l;p=l.llama_model_quantize_default_params();"
                      f"p.ftype=l.LLAMA_FTYPE_MOSTLY_{args.policy};p.nthread={nthread};"
                      "sys.exit(l.llama_model_quantize(sys.argv[1].encode(),sys.argv[2].encode(),ctypes.byref(p)))")
        im = ["--imatrix", str(Path(args.imatrix).resolve())] if args.imatrix else []
        if im:
            quant = measure([str(llamacpp_tools.tool("llama-quantize")), *im, str(ref_f16), str(ref_q),
                             args.policy, str(nthread)])
        else:
            quant = measure([PY, "-c", quant_code, str(ref_f16), str(ref_q)])
        report = d / "report.json"
        mine = measure([str(REPO / ".venv/bin/convert"), "hf-to-gguf", str(model), "--policy", args.policy,
                        "-o", str(ours), "--device", args.device, "--quiet", "--report", str(report), *im])
        stages = json.loads(report.read_text())["stages"]
        mine_q = measure([str(REPO / ".venv/bin/quantize"), "gguf", str(ref_f16), "--policy", args.policy,
                          "-o", str(ours_q), "--device", args.device, "--quiet", "--report", str(report), *im])
        stages_q = json.loads(report.read_text())["stages"]
        from refs import tensors_of
        identical = tensors_of(ours) == tensors_of(ref_q) and tensors_of(ours_q) == tensors_of(ref_q)
        size = ref_q.stat().st_size
    ref_total = conv[0] + quant[0]
    fig = {
        "model": str(model), "policy": args.policy, "device": args.device, "nthread_llamacpp": nthread,
        "imatrix": args.imatrix,
        "llamacpp_convert_s": conv[0], "llamacpp_quantize_s": quant[0], "llamacpp_total_s": ref_total,
        "llamacpp_peak_rss_mib": max(conv[1], quant[1]), "llamacpp_convert_rss_mib": conv[1],
        "llamacpp_quantize_rss_mib": quant[1],
        "ours_total_s": mine[0], "ours_peak_rss_mib": mine[1], "ours_stages_s": stages,
        "ours_requantize_s": mine_q[0], "ours_requantize_stages_s": stages_q,
        "ratio_total_ours_over_llamacpp": mine[0] / ref_total,
        "ratio_requantize_ours_over_llamacpp": mine_q[0] / quant[0],
        "identical_tensors": identical, "output_bytes": size,
    }
    print(f"model {model} ({args.policy}, ours on {args.device}, llama.cpp nthread={nthread})")
    print(f"  llama.cpp  convert f16 {conv[0]:7.1f} s  {conv[1]:7.0f} MiB | quantize {quant[0]:7.1f} s "
          f"{quant[1]:7.0f} MiB | total {ref_total:7.1f} s")
    print(f"  quantpress hf-to-gguf  {mine[0]:7.1f} s  {mine[1]:7.0f} MiB peak RSS; stages "
          + ", ".join(f"{k} {v:.1f} s" for k, v in stages.items()))
    print(f"  quantpress quantize gguf (llama.cpp's F16 file) {mine_q[0]:7.1f} s  {mine_q[1]:7.0f} MiB; stages "
          + ", ".join(f"{k} {v:.1f} s" for k, v in stages_q.items()))
    print(f"  ratio ours/llama.cpp end to end: {fig['ratio_total_ours_over_llamacpp']:.2f}x time; "
          f"requantizing the F16 file, quantize gguf/llama-quantize: "
          f"{fig['ratio_requantize_ours_over_llamacpp']:.2f}x; identical tensors: {identical}")
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
