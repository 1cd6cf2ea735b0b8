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

``--hidden H --heads N --kv-heads K`` first widens the model with zeros, so that every linear
reads rows whose width is a multiple of 256 and llama.cpp's K-quants and IQ4_XS apply to
every tensor as they are (SmolLM2: ``--hidden 768 --heads 12 --kv-heads 4``; its 576 is not a
multiple of 256, so its policies fall back to Q5_0 / IQ4_NL on most tensors):

- the residual stream gets ``H - hidden`` zero channels (zero columns in the embedding and
  the readers, zero rows in the writers) before it is rotated, so that after the rotation no
  channel is zero; RMSNorm's mean over ``H`` channels is ``hidden/H`` of the old one, so the
  norms' weights take a factor ``sqrt(hidden/H)`` and ``rms_norm_eps`` becomes
  ``eps * hidden/H`` (exactly the old function);
- the attention gets zero heads after the old ones (``N - heads`` query heads, ``K -
  kv_heads`` key/value heads, the same ``head_dim`` and the same heads per key/value head, so
  llama.cpp's GQA-dependent type rules see the same ratio): a zero key/value head gives zero
  values, and o_proj's columns for the new heads are zero.

Computed in float64, written in float16 with the config (``tie_word_embeddings`` false) and
the tokenizer files. Llama-style checkpoints without biases (LlamaForCausalLM, one
model.safetensors file) only.

    python scripts/rotate_model.py [--model DIR] -o out/smollm2-rotated
    python scripts/rotate_model.py --hidden 768 --heads 12 --kv-heads 4 -o out/smollm2-wide
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def widen(sd: dict, config: dict, hidden: int, heads: int, kv_heads: int) -> tuple[dict, dict]:
    """The same model with zero channels and zero attention heads added (float64 in and out;
    keys of ``LlamaForCausalLM``; ``config`` a config.json dict). Returns (state dict, config
    with ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` and
    ``rms_norm_eps`` updated). Raises ValueError where a size would shrink or the heads per
    key/value head would change."""
    import torch

    h, n_h = config["hidden_size"], config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_h
    hd = config.get("head_dim") or h // n_h
    if hidden < h or heads < n_h or kv_heads < n_kv:
        raise ValueError(f"--hidden/--heads/--kv-heads {hidden}/{heads}/{kv_heads}: at least {h}/{n_h}/{n_kv}")
    if heads % kv_heads or heads // kv_heads != n_h // n_kv:
        raise ValueError(f"--heads {heads} / --kv-heads {kv_heads}: must keep {n_h // n_kv} heads per key/value head")

    def pad(t, rows: int, cols: int | None = None):
        z = t.new_zeros((rows, t.shape[1] if cols is None else cols))
        z[:t.shape[0], :t.shape[1]] = t
        return z

    norm = (h / hidden) ** 0.5
    out = {}
    for k, v in sd.items():
        if k.endswith("norm.weight"):
            out[k] = torch.cat([v, v.new_zeros(hidden - h)]) * norm
        elif k in ("model.embed_tokens.weight", "lm_head.weight"):
            out[k] = pad(v, v.shape[0], hidden)
        elif k.endswith("self_attn.q_proj.weight"):
            out[k] = pad(v, heads * hd, hidden)
        elif k.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            out[k] = pad(v, kv_heads * hd, hidden)
        elif k.endswith("self_attn.o_proj.weight"):
            out[k] = pad(v, hidden, heads * hd)
        elif k.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            out[k] = pad(v, v.shape[0], hidden)
        elif k.endswith("mlp.down_proj.weight"):
            out[k] = pad(v, hidden)
        else:
            raise ValueError(f"{k}: not a tensor of LlamaForCausalLM without biases")
    cfg = dict(config, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hd,
               rms_norm_eps=config["rms_norm_eps"] * h / hidden)
    return out, cfg


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

    from bench_common import add_model_arg, model_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arg(ap)
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, help="widen the residual stream to this many channels first")
    ap.add_argument("--heads", type=int, help="attention heads after widening (zero heads added)")
    ap.add_argument("--kv-heads", type=int, help="key/value heads after widening (zero heads added)")
    args = ap.parse_args()
    src = model_dir(args.model)
    out = Path(args.output)
    config = json.loads((src / "config.json").read_text())
    if config.get("architectures") != ["LlamaForCausalLM"] or config.get("attention_bias") or config.get("mlp_bias"):
        raise SystemExit(f"{src}: rotate_model.py handles LlamaForCausalLM without biases")
    sd = {k: v.double() for k, v in load_file(str(src / "model.safetensors")).items()}
    tied = "lm_head.weight" not in sd
    if args.hidden or args.heads or args.kv_heads:
        try:
            sd, config = widen(sd, config, args.hidden or config["hidden_size"],
                               args.heads or config["num_attention_heads"],
                               args.kv_heads or config.get("num_key_value_heads") or config["num_attention_heads"])
        except ValueError as e:
            raise SystemExit(f"{src}: {e}")
    rotated = rotate(sd, config["num_hidden_layers"], tied, args.seed)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.float16).contiguous() for k, v in rotated.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors") and f.is_file():
            shutil.copy(f, out / f.name)
    print(f"wrote {out}: {src.name} with its residual stream rotated (seed {args.seed}), "
          f"{len(rotated)} tensors, untied lm_head, hidden {config['hidden_size']}, "
          f"{config['num_attention_heads']} heads / {config['num_key_value_heads']} key/value heads")


if __name__ == "__main__":
    main()
