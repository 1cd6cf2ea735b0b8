#!/usr/bin/env python3
"""An equivalent Llama-family model whose weights are off any quantization grid: the residual
stream turned by a random orthogonal matrix, the computational invariance of QuaRot
(Ashkboos et al., 2024, "QuaRot: Outlier-Free 4-Bit Inference in Rotated LLMs", §4) and
SliceGPT (Ashkboos et al., 2024, §3.1).

SmolLM2-135M as quantpress installs it is a dequantized Q4_1 GGUF: every block of 32 weights
holds at most 16 evenly spaced values, which the affine 32-wide types (Q4_1, Q4_K) nearly
reproduce and the i-quants do not, so comparing those types on it favours the first
(README, "GGUF with importance weights"). The rotated model computes the same function (its
perplexity equals the original's to the FP16 rounding of the new weights) with weights that
mix whole rows or columns of the old ones.

With ``Q`` a random orthogonal [hidden, hidden] matrix (seed 0) and the residual stream
``h' = h Q``:

- each RMSNorm's weight is folded into the linears that read its output (``W diag(g)``) and
  set to 1, so that the norm commutes with ``Q`` (``‖hQ‖ = ‖h‖``);
- the embedding and every linear that reads the residual stream (q, k, v, gate, up, lm_head)
  take ``W Q``; the linears that write to it (o_proj, down_proj) take ``Qᵀ W``;
- tied embeddings are untied (the final norm's weight goes into lm_head only).

Computed in float64, written in float16 with the config (``tie_word_embeddings`` false) and
the tokenizer files. Llama-style checkpoints without biases (LlamaForCausalLM, one
model.safetensors file) only.

    python scripts/rotate_model.py [--model DIR] -o out/smollm2-rotated
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def rotate(sd: dict, n_layers: int, tied: bool, seed: int = 0) -> dict:
    """The rotated state dict (float64 in, float64 out; keys of ``LlamaForCausalLM``).

    ``sd``: float64 tensors; ``n_layers``: decoder layers; ``tied``: no ``lm_head.weight`` in
    ``sd`` (it is the embedding). Returns a new dict with ``lm_head.weight`` and every norm
    weight 1."""
    import torch

    emb = sd["model.embed_tokens.weight"]
    h = emb.shape[1]
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(h, h, generator=g, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))       # Haar-distributed
    out = dict(sd)
    out["model.embed_tokens.weight"] = emb @ q
    for i in range(n_layers):
        p = f"model.layers.{i}."
        for norm, readers in (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                              ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))):
            gw = sd[p + norm + ".weight"]
            for r_ in readers:
                out[p + r_ + ".weight"] = (sd[p + r_ + ".weight"] * gw) @ q
            out[p + norm + ".weight"] = torch.ones_like(gw)
        for writer in ("self_attn.o_proj", "mlp.down_proj"):
            out[p + writer + ".weight"] = q.T @ sd[p + writer + ".weight"]
    head = emb if tied else sd["lm_head.weight"]
    out["lm_head.weight"] = (head * sd["model.norm.weight"]) @ q
    out["model.norm.weight"] = torch.ones_like(sd["model.norm.weight"])
    return out


def main() -> None:
    import torch
    from safetensors.torch import load_file, save_file

    from quantpress import assets

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="HF directory (default: SmolLM2-135M-Instruct from the cache)")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    src = Path(args.model) if args.model else assets.smollm2_dir()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    if config.get("architectures") != ["LlamaForCausalLM"] or config.get("attention_bias") or config.get("mlp_bias"):
        raise SystemExit(f"{src}: rotate_model.py handles LlamaForCausalLM without biases")
    sd = {k: v.double() for k, v in load_file(str(src / "model.safetensors")).items()}
    tied = "lm_head.weight" not in sd
    rotated = rotate(sd, config["num_hidden_layers"], tied, args.seed)
    save_file({k: v.to(torch.float16).contiguous() for k, v in rotated.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors") and f.is_file():
            shutil.copy(f, out / f.name)
    print(f"wrote {out}: {src.name} with its residual stream rotated (seed {args.seed}), "
          f"{len(rotated)} tensors, untied lm_head")


if __name__ == "__main__":
    main()
