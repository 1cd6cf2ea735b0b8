"""``scripts/rotate_model.py``: the rotated model (the off-grid SmolLM2 of the README's IQ4_XS
comparison) computes the same function as the original, with weights that are not the
original's."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rotate_model import rotate, widen


def test_rotation_keeps_the_logits_and_changes_every_weight():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):        # norms that are not all ones: folded
                p.copy_(torch.rand_like(p) + 0.5)
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    rotated = rotate(sd, cfg.num_hidden_layers, tied=True)
    untied = LlamaForCausalLM(LlamaConfig(**{**cfg.to_dict(), "tie_word_embeddings": False})).double().eval()
    untied.load_state_dict(rotated)
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        a, b = model(ids).logits, untied(ids).logits
    # (transformers' RMSNorm and rotary embedding compute in float32: differences of 1e-7 here,
    # against 0.1 and more with a norm left unfolded)
    assert torch.allclose(a, b, atol=1e-6, rtol=0), (a - b).abs().max()
    for k, v in sd.items():
        if k.endswith("norm.weight"):
            assert torch.equal(rotated[k], torch.ones_like(v)), k
        else:
            assert not torch.allclose(rotated[k], v), k


def test_widened_model_keeps_the_logits():
    """Zero channels, zero heads and the norms' factor and eps: the same function, every linear
    wider (and after the rotation no residual channel is zero)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=128, tie_word_embeddings=True,
                      rms_norm_eps=1e-2)     # large, so that an eps left as it was shows
    model = LlamaForCausalLM(cfg).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand_like(p) + 0.5)
    sd = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    wide, wcfg = widen(sd, cfg.to_dict(), 96, 6, 3)
    assert (wcfg["hidden_size"], wcfg["num_attention_heads"], wcfg["num_key_value_heads"]) == (96, 6, 3)
    rotated = rotate(wide, cfg.num_hidden_layers, tied=True)
    wcfg["tie_word_embeddings"] = False
    big = LlamaForCausalLM(LlamaConfig(**wcfg)).double().eval()
    big.load_state_dict(rotated)
    assert big.model.layers[0].self_attn.o_proj.weight.shape == (96, 96)
    assert big.model.layers[0].self_attn.k_proj.weight.shape == (48, 96)
    assert (big.model.embed_tokens.weight.abs().amin(0) > 0).all()     # no zero channel left
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        a, b = model(ids).logits, big(ids).logits
    assert torch.allclose(a, b, atol=1e-6, rtol=0), (a - b).abs().max()


def test_widen_refuses_a_changed_group():
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128)
    model = LlamaForCausalLM(cfg).double()
    with pytest.raises(ValueError, match="2 heads per key/value head"):
        widen(model.state_dict(), cfg.to_dict(), 96, 6, 2)
