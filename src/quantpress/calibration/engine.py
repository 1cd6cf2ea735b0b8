"""Layer-streaming forward pass over a Hugging Face causal LM, for calibration.

The model is never loaded whole. A skeleton of the transformers model is built on the
``meta`` device (no memory), which gives transformers' own module classes —
``LlamaDecoderLayer``, ``Qwen2DecoderLayer``, ``Qwen3DecoderLayer``, … —, the model's own
rotary embedding class and its attention-mask functions. Then, one decoder layer at a time,
that layer's tensors are read from the safetensors files (``safetensors.safe_open``, with
``model.safetensors.index.json`` shards) onto the compute device and the layer runs over the
hidden states of all calibration rows, batch by batch. Only one layer's weights plus the
hidden states (two copies: the layer's inputs and outputs; one where no consumer needs the
inputs after the layer, each batch's outputs written over its inputs) are held; the hidden
states can be kept on CPU and moved to the device one batch slice at a time.

The computation is the one of ``AutoModelForCausalLM.forward`` (transformers 5.x): embedding,
``position_ids = arange(seqlen)``, ``rotary_emb(hidden, position_ids)`` once, the causal
mask from ``masking_utils.create_causal_mask`` (``create_sliding_window_causal_mask`` for
layers whose ``config.layer_types`` entry is "sliding_attention"), each decoder layer called
with the same keyword arguments as ``LlamaModel.forward`` calls it, the final norm and
``lm_head`` (``embed_tokens`` when the embeddings are tied). In float32 the result equals a
plain transformers forward (tests/test_calibration.py).

Supported: dense decoder-only models whose checkpoint names are transformers' module names
(llama, qwen2, qwen3 and other Llama-like families). Checkpoints whose tensors transformers
renames or fuses on load (e.g. MoE experts) are refused with InputError naming the tensor.
"""
from __future__ import annotations

import copy
import functools
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from quantpress.errors import InputError

_MISSING = object()
HooksFactory = Callable[[int, nn.Module], object]
OnLayer = Callable[[int, nn.Module, torch.Tensor, torch.Tensor, "LayerContext"], "torch.Tensor | None"]


# --------------------------------------------------------------------------------------------
# safetensors reader

class SafetensorsDir:
    """Tensors of a model directory by checkpoint name, read one at a time with
    ``safetensors.safe_open`` (memory-mapped; nothing else is read). Handles a single
    ``model.safetensors`` or shards listed in ``model.safetensors.index.json``.

    Every read opens its file and closes it again: a safetensors handle keeps its memory map,
    and the pages read through it would stay in the process's RSS, so that a pass over every
    layer would end holding the whole checkpoint (``scripts/bench_imatrix.py --samples 128``
    measures the peak RSS; the figures with and without kept handles are in
    docs/benchmarks.md)."""

    def __init__(self, model_dir: str | Path):
        from safetensors import safe_open

        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        self._files: dict[str, Path] = {}
        if index.is_file():
            try:
                wmap = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise InputError(f"{index}: unreadable shard index ({e})") from e
            for name, fname in wmap.items():
                self._files[name] = self.dir / fname
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise InputError(f"{self.dir}: no *.safetensors files (only safetensors "
                                 f"checkpoints are supported)")
            for f in files:
                try:
                    with safe_open(str(f), framework="pt") as h:
                        for name in h.keys():
                            self._files[name] = f
                except Exception as e:
                    raise InputError(f"{f}: not a readable safetensors file ({e})") from e

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def keys(self):
        """Checkpoint names of every tensor."""
        return self._files.keys()

    def get(self, name: str, device="cpu", dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor ``name`` on ``device``; floating tensors cast to ``dtype`` if given.
        Raises InputError if the tensor is absent or its file unreadable."""
        with self._handle(name) as h:
            t = h.get_tensor(name)
        if dtype is not None and t.is_floating_point():
            return t.to(device=device, dtype=dtype)
        return t.to(device=device)

    def _handle(self, name: str):
        """A new ``safe_open`` handle of the file holding ``name`` (a context manager: the
        caller closes it)."""
        from safetensors import safe_open

        f = self._files.get(name)
        if f is None:
            raise InputError(f"{self.dir}: tensor '{name}' not found in the checkpoint")
        if not f.is_file():
            raise InputError(f"{f}: shard listed in the index is missing (needed for '{name}')")
        try:
            return safe_open(str(f), framework="pt", device="cpu")
        except Exception as e:
            raise InputError(f"{f}: not a readable safetensors file ({e})") from e

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of tensor ``name`` (read from the header only). Raises InputError if absent."""
        with self._handle(name) as h:
            return tuple(h.get_slice(name).get_shape())

    def get_rows(self, name: str, lo: int, hi: int, device="cpu",
                 dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows ``[lo, hi)`` of tensor ``name`` (along dim 0), read without reading the rest
        of the tensor; cast to ``dtype`` if given. Raises InputError if the tensor is absent."""
        with self._handle(name) as h:
            t = h.get_slice(name)[lo:hi]
        return t.to(device=device, dtype=dtype) if dtype is not None else t.to(device=device)

    def files(self) -> list[Path]:
        """The safetensors files holding the tensors, sorted."""
        return sorted(set(self._files.values()))

    def parameter_count(self) -> int:
        """Elements over every tensor of the checkpoint (read from the headers only)."""
        from safetensors import safe_open

        total = 0
        for f in self.files():
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    n = 1
                    for d in h.get_slice(k).get_shape():
                        n *= int(d)
                    total += n
        return total

    def close(self) -> None:
        """Nothing to release: no file is held open between reads (kept for the readers that
        wrap this one and close it)."""


# --------------------------------------------------------------------------------------------
# Streaming model

#: vocabulary rows of the embedding matrix read at a time by :meth:`StreamingModel.embed`
EMBED_BLOCK_ROWS = 4096

#: one transformers model skeleton built at a time (see :class:`StreamingModel`)
_BUILD_LOCK = threading.Lock()


def _default_dtype(device: torch.device, config) -> torch.dtype:
    if device.type == "cpu":
        return torch.float32
    d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if d in (torch.float16, torch.bfloat16, torch.float32) else torch.float16


class StreamingModel:
    """A causal LM read from ``model_dir`` one module at a time.

    ``device``: compute device ("cpu", "cuda", "cuda:1", …). ``dtype``: compute dtype of the
    weights and hidden states (default float32 on CPU, the checkpoint's dtype on CUDA; fp16
    weights are upcast exactly). ``attn_implementation``: transformers' attention backend
    ("sdpa" default, or "eager").

    Attributes: ``config`` (the transformers config), ``num_layers``, ``hidden_size``,
    ``layer_prefix`` (checkpoint name prefix of the decoder layers, e.g. "model.layers."),
    ``embed_name`` / ``norm_name`` / ``lm_head_name`` (module names of the token embedding,
    the final norm and the output head, e.g. "model.embed_tokens", "model.norm", "lm_head"),
    ``weights`` (the tensor reader). Shapes without weights: :meth:`layer_skeleton`,
    :meth:`head_skeleton`, :meth:`skeleton_shapes`.
    Raises InputError if the directory has no usable config.json, the architecture is unknown
    to transformers, or a tensor is missing or has the wrong shape."""

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, attn_implementation: str = "sdpa"):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.dir = Path(model_dir)
        if not (self.dir / "config.json").is_file():
            raise InputError(f"{self.dir}: no config.json (expected a Hugging Face model directory)")
        try:
            config = AutoConfig.from_pretrained(self.dir)
        except Exception as e:
            raise InputError(f"{self.dir / 'config.json'}: not a usable transformers config ({e})") from e
        try:
            # transformers sets torch's default dtype (process-wide) to the config's while it
            # builds the model and then back: two builds at once in two threads could leave
            # the other's dtype behind
            with _BUILD_LOCK, torch.device("meta"):
                skel = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
        except Exception as e:
            raise InputError(f"{self.dir}: transformers cannot build a causal LM for model_type "
                             f"'{getattr(config, 'model_type', '?')}' ({e})") from e
        self.device = torch.device(device)
        self.config = skel.config
        self.dtype = dtype or _default_dtype(self.device, self.config)
        self.weights = SafetensorsDir(self.dir)

        self._skel = skel
        dec = getattr(skel, skel.base_model_prefix)
        for attr in ("embed_tokens", "layers", "norm", "rotary_emb"):
            if not hasattr(dec, attr):
                raise InputError(f"{self.dir}: {type(dec).__name__} has no '{attr}'; only "
                                 f"Llama-like decoder-only models are supported")
        self._decoder = dec
        names = {id(m): n for n, m in skel.named_modules()}
        self.embed_name = names[id(dec.embed_tokens)]
        self.norm_name = names[id(dec.norm)]
        self.layer_prefix = names[id(dec.layers)] + "."
        self.num_layers = int(self.config.num_hidden_layers)
        self.hidden_size = int(self.config.hidden_size)
        self.lm_head_name = names[id(skel.get_output_embeddings())]
        with torch.device(self.device):  # inv_freq computed for real (not meta), in float32
            self.rotary_emb = type(dec.rotary_emb)(config=self.config)
        self._head: tuple[nn.Module, nn.Module] | None = None
        self._masks: dict = {}
        self._pos: dict = {}

    # ---- shapes without weights ---------------------------------------------------------------

    def layer_skeleton(self, index: int) -> nn.Module:
        """Decoder layer ``index`` on the ``meta`` device: its modules and shapes, no weights
        (do not run it; :meth:`load_layer` gives the real one)."""
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} of {self.num_layers}")
        return self._decoder.layers[index]

    def head_skeleton(self) -> nn.Module:
        """The output head (``lm_head``) on the ``meta`` device: ``in_features``,
        ``out_features``, no weights."""
        return self._skel.get_output_embeddings()

    def skeleton_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter and buffer of the transformers model by checkpoint name → shape, as
        config.json implies them (read from the ``meta`` skeleton; nothing is loaded)."""
        return {n: tuple(t.shape) for n, t in self._skel.state_dict().items()}

    @property
    def tied_embeddings(self) -> bool:
        """Whether lm_head reuses the token embedding (``tie_word_embeddings``)."""
        return bool(getattr(self.config, "tie_word_embeddings", False))

    # ---- module loading ----------------------------------------------------------------------

    def _materialize(self, meta_module: nn.Module, prefix: str,
                     rename: dict[str, str] | None = None) -> nn.Module:
        """A copy of ``meta_module`` with its tensors read from the checkpoint (names
        ``prefix + local``, or ``rename[local]``) onto the device in ``self.dtype``."""
        mod = copy.deepcopy(meta_module)
        want = mod.state_dict()
        sd = {}
        for local, meta_t in want.items():
            name = (rename or {}).get(local, prefix + local)
            t = self.weights.get(name, self.device, self.dtype)
            if tuple(t.shape) != tuple(meta_t.shape):
                raise InputError(f"{self.dir}: tensor '{name}' has shape {tuple(t.shape)}, "
                                 f"expected {tuple(meta_t.shape)} from config.json")
            sd[local] = t
        mod.load_state_dict(sd, strict=True, assign=True)
        left = [n for n, t in list(mod.named_parameters()) + list(mod.named_buffers()) if t.is_meta]
        if left:
            raise InputError(f"{self.dir}: cannot stream {type(mod).__name__}: tensors "
                             f"{left} are not in the checkpoint")
        mod.requires_grad_(False)
        mod.eval()
        return mod

    def load_layer(self, index: int) -> nn.Module:
        """Decoder layer ``index`` (transformers' own class) with its weights on the device.
        Reads only that layer's tensors."""
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} of {self.num_layers}")
        return self._materialize(self._decoder.layers[index], f"{self.layer_prefix}{index}.")

    def layers(self, progress: bool = True, start: int = 0) -> Iterator[tuple[int, nn.Module]]:
        """Yield ``(index, layer)`` for every decoder layer from ``start`` on, in order, loading
        each when it is reached and dropping it when the caller asks for the next one (tqdm
        bar over layers)."""
        from tqdm.auto import tqdm

        for i in tqdm(range(start, self.num_layers), desc="layers", unit="layer", disable=not progress,
                      initial=start, total=self.num_layers):
            layer = self.load_layer(i)
            yield i, layer
            del layer

    def embedding(self) -> nn.Module:
        """The token embedding module (``embed_tokens``) on the device."""
        return self._materialize(self._decoder.embed_tokens, self.embed_name + ".")

    def head(self) -> tuple[nn.Module, nn.Module]:
        """(final norm, lm_head) on the device, loaded once and cached. With tied embeddings
        (``tie_word_embeddings``), lm_head's weight is ``embed_tokens.weight``, as transformers
        ties it; otherwise ``lm_head.weight`` must be in the checkpoint."""
        if self._head is None:
            norm = self._materialize(self._decoder.norm, self.norm_name + ".")
            head_meta = self.head_skeleton()
            key = self.lm_head_name + ".weight"
            if self.tied_embeddings:  # transformers ties lm_head to embed_tokens whatever the file holds
                rename = {"weight": self.embed_name + ".weight"}
            elif key in self.weights:
                rename = None
            else:
                raise InputError(f"{self.dir}: tensor '{key}' not found and the embeddings are "
                                 f"not tied (tie_word_embeddings is false)")
            lm_head = self._materialize(head_meta, self.lm_head_name + ".", rename)
            self._head = (norm, lm_head)
        return self._head

    @classmethod
    def over_weights(cls, config: dict, weights, source: str | Path, device="cpu",
                     dtype: torch.dtype | None = None, attn_implementation: str = "sdpa") -> "StreamingModel":
        """A streaming model built from the HF ``config`` dict whose tensors come from
        ``weights`` (any object with ``keys()``, ``in`` and ``get(name, device, dtype)`` under HF
        checkpoint names, e.g. a GGUF or AWQ reader that dequantizes on demand) instead of a
        safetensors directory. ``source`` becomes ``dir`` (for messages). Raises InputError
        like the constructor."""
        import tempfile

        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory(prefix="quantpress-model-") as tmp:
            # the constructor reads config.json and lists safetensors files: give it the config
            # and an empty file, then swap in the real weights
            Path(tmp, "config.json").write_text(json.dumps(config))
            save_file({}, str(Path(tmp, "model.safetensors")))
            sm = cls(tmp, device=device, dtype=dtype, attn_implementation=attn_implementation)
        sm.weights = weights
        sm.dir = Path(source)
        return sm

    def release(self) -> None:
        """Drop the cached head and masks (frees their device memory)."""
        self._head = None
        self._masks.clear()
        self._pos.clear()

    # ---- computation -------------------------------------------------------------------------

    @torch.no_grad()
    def embed(self, tokens: torch.Tensor, out_device=None, batch_size: int | None = None) -> torch.Tensor:
        """Input embeddings of ``tokens`` (int64 [rows, seqlen]) → ``self.dtype``
        [rows, seqlen, hidden] on ``out_device`` (default: the compute device). Raises
        InputError if a token id is outside the vocabulary."""
        tokens = torch.as_tensor(tokens)
        if tokens.ndim != 2:
            raise InputError(f"calibration tokens must be [rows, seqlen], got shape {tuple(tokens.shape)}")
        vocab = int(self.config.vocab_size)
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
            raise InputError(f"token ids must lie in [0, {vocab}); got [{int(tokens.min())}, "
                             f"{int(tokens.max())}] (tokenizer does not match the model?)")
        out_device = self.device if out_device is None else torch.device(out_device)
        if type(self._decoder.embed_tokens) is nn.Embedding and hasattr(self.weights, "get_rows"):
            return self._embed_by_rows(tokens, out_device)
        emb = self.embedding()
        n, seqlen = tokens.shape
        bs = batch_size or n
        out = torch.empty(n, seqlen, self.hidden_size, dtype=self.dtype, device=out_device)
        for a in range(0, n, bs):
            out[a:a + bs] = emb(tokens[a:a + bs].to(self.device)).to(out_device)
        del emb
        return out

    def _embed_by_rows(self, tokens: torch.Tensor, out_device: torch.device) -> torch.Tensor:
        """:meth:`embed` for a plain ``nn.Embedding`` over a checkpoint that reads row ranges:
        the embedding matrix is read :data:`EMBED_BLOCK_ROWS` vocabulary rows at a time (only
        blocks that some token uses) and cast to ``self.dtype``, so neither the whole matrix
        nor a float32 copy of it is ever in memory. Same values as ``nn.Embedding``."""
        name = self.embed_name + ".weight"
        want = tuple(self._decoder.embed_tokens.weight.shape)
        got = tuple(self.weights.shape(name))
        if got != want:
            raise InputError(f"{self.dir}: tensor '{name}' has shape {got}, expected {want} "
                             f"from config.json")
        vocab, hidden = want
        n, seqlen = tokens.shape
        out = torch.empty(n, seqlen, hidden, dtype=self.dtype, device=out_device)
        flat_out = out.view(n * seqlen, hidden)
        flat = tokens.reshape(-1).to(torch.int64)
        order = torch.argsort(flat, stable=True)
        ids = flat[order]
        edges = torch.arange(0, vocab + EMBED_BLOCK_ROWS, EMBED_BLOCK_ROWS).clamp_max(vocab)
        bounds = torch.searchsorted(ids, edges).tolist()
        for b in range(len(edges) - 1):
            a, e = bounds[b], bounds[b + 1]
            if a == e:
                continue
            lo, hi = int(edges[b]), int(edges[b + 1])
            rows = self.weights.get_rows(name, lo, hi, self.device, self.dtype)
            sel = (ids[a:e] - lo).to(self.device)
            flat_out[order[a:e].to(out_device)] = rows[sel].to(out_device)
            del rows
        return out

    def positions(self, seqlen: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """(position_ids int64 [1, seqlen], (cos, sin) ``self.dtype`` [1, seqlen, head_dim]) on
        the device, from the model's own ``rotary_emb`` (cached per seqlen)."""
        got = self._pos.get(seqlen)  # one lookup: another thread may release() meanwhile
        if got is None:
            pos = torch.arange(seqlen, device=self.device).unsqueeze(0)
            x = torch.empty(1, 1, 1, dtype=self.dtype, device=self.device)
            got = self._pos[seqlen] = (pos, self.rotary_emb(x, pos))
        return got

    def attention_mask(self, layer_index: int, rows: int, seqlen: int):
        """The attention mask transformers builds for decoder layer ``layer_index`` on a batch
        of ``rows`` × ``seqlen`` tokens without padding (``create_causal_mask``, or
        ``create_sliding_window_causal_mask`` for "sliding_attention" layers). May be None
        (sdpa's ``is_causal`` path)."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        types = getattr(self.config, "layer_types", None)
        kind = types[layer_index] if types else "full_attention"
        key = (kind, rows, seqlen)
        mask = self._masks.get(key, _MISSING)  # one lookup: may be None (sdpa's is_causal)
        if mask is not _MISSING:
            return mask
        fn = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
        embeds = torch.empty(1, 1, self.hidden_size, dtype=self.dtype,
                             device=self.device).expand(rows, seqlen, self.hidden_size)
        pos, _ = self.positions(seqlen)
        mask = self._masks[key] = fn(config=self.config, inputs_embeds=embeds, attention_mask=None,
                                     past_key_values=None, position_ids=pos)
        return mask

    def layer_kwargs(self, layer_index: int, rows: int, seqlen: int) -> dict:
        """Keyword arguments transformers' model forward passes to decoder layer
        ``layer_index`` (attention_mask, position_ids, position_embeddings, no cache). Also
        valid for the layer's ``self_attn`` module (AWQ's loss on the attention output)."""
        pos, pe = self.positions(seqlen)
        return dict(attention_mask=self.attention_mask(layer_index, rows, seqlen),
                    position_ids=pos, position_embeddings=pe, past_key_values=None, use_cache=False)

    @torch.no_grad()
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final RMSNorm of ``hidden`` [..., hidden] (moved to the device) → ``self.dtype``."""
        norm, _ = self.head()
        return norm(hidden.to(self.device, self.dtype))

    @torch.no_grad()
    def final_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [..., vocab] (``self.dtype``, on the device) of the last decoder layer's
        output ``hidden`` [..., hidden]: ``lm_head(norm(hidden))``. Call it on batch slices:
        the logits of all rows may not fit."""
        norm, lm_head = self.head()
        return lm_head(norm(hidden.to(self.device, self.dtype)))


# --------------------------------------------------------------------------------------------
# The streamed pass

@dataclass
class LayerContext:
    """What a caller needs to re-run (parts of) decoder layer ``index`` the way the engine
    does: ``forward(module, hidden)`` runs any module over all rows batch by batch, with the
    layer's keyword arguments (mask, positions) when ``with_kwargs``."""

    model: StreamingModel
    index: int
    batch_size: int
    hidden_device: torch.device
    check_finite: bool = True

    def kwargs(self, rows: int, seqlen: int) -> dict:
        """Decoder-layer keyword arguments for a batch of ``rows`` × ``seqlen``."""
        return self.model.layer_kwargs(self.index, rows, seqlen)

    @torch.no_grad()
    def forward(self, module: nn.Module, hidden: torch.Tensor, with_kwargs: bool = True,
                what: str | None = None, out: torch.Tensor | None = None,
                first_row: int = 0) -> torch.Tensor:
        """``module`` over ``hidden`` [rows, seqlen, hidden_in] in batches of ``batch_size``
        rows (each batch moved to the compute device), output [rows, seqlen, out] in
        ``model.dtype`` on ``hidden_device``. Tuple outputs (``self_attn``) give their first
        element. ``out``: a tensor to write the output into when its shape, dtype and device
        are those of the output (an earlier output no longer needed, or ``hidden`` itself: each
        batch's output is written over its rows once the module has run on them; else a new
        one is made).
        ``first_row``: the calibration row ``hidden[0]`` is (when ``hidden`` is a slice), for
        the message. Raises InputError naming the layer and the rows if the output holds
        NaN/Inf."""
        m = self.model
        rows, seqlen = hidden.shape[:2]
        for a in range(0, rows, self.batch_size):
            x = hidden[a:a + self.batch_size].to(m.device, m.dtype)
            kw = self.kwargs(x.shape[0], seqlen) if with_kwargs else {}
            y = module(x, **kw)
            if isinstance(y, (tuple, list)):
                y = y[0]
            if self.check_finite and not bool(torch.isfinite(y).all()):
                raise InputError(f"non-finite hidden states (NaN/Inf) in the output of "
                                 f"{what or f'decoder layer {self.index}'} (rows {first_row + a}.."
                                 f"{first_row + a + x.shape[0] - 1}); "
                                 f"the model overflows in {str(m.dtype).replace('torch.', '')} "
                                 f"or its weights are corrupt")
            if a == 0 and (out is None or out.shape != (rows, seqlen, *y.shape[2:])
                           or out.dtype != y.dtype or out.device != self.hidden_device):
                out = torch.empty(rows, seqlen, *y.shape[2:], dtype=y.dtype, device=self.hidden_device)
            out[a:a + x.shape[0]] = y.to(self.hidden_device)
        return out


def _hidden_device(model: StreamingModel, rows: int, seqlen: int, hidden_device,
                   copies: int = 2) -> torch.device:
    if hidden_device not in (None, "auto"):
        return torch.device(hidden_device)
    if model.device.type != "cuda":
        return model.device
    need = copies * rows * seqlen * model.hidden_size * torch.finfo(model.dtype).bits // 8
    free, _ = torch.cuda.mem_get_info(model.device)
    return model.device if need < 0.4 * free else torch.device("cpu")


@torch.no_grad()
def run(model: StreamingModel, tokens: torch.Tensor, hooks_factory: HooksFactory | None = None,
        on_layer: OnLayer | None = None, batch_size: int | None = None, hidden_device=None,
        progress: bool = True, check_finite: bool = True, checkpoint=None,
        state=None, keep_inputs: bool = True) -> torch.Tensor:
    """Stream ``tokens`` (int64 [rows, seqlen]) through every decoder layer of ``model``.

    Per layer ``i`` (loaded alone onto the device):

    1. ``hooks_factory(i, layer)``, if given, attaches capture hooks and returns an object with
       ``remove()`` (e.g. :class:`calibration.stats.StatsCollector`, or a list of handles);
    2. the layer runs over all rows in batches of ``batch_size`` (default: all rows at once, as
       AutoAWQ does); the hooks are removed;
    3. ``on_layer(i, layer, inputs, outputs, ctx)``, if given, may change the layer (e.g.
       quantize it) and may return a tensor that replaces ``outputs`` as the next layer's
       input (e.g. the quantized layer's outputs via ``ctx.forward(layer, inputs)``);
       ``ctx`` is a :class:`LayerContext`.

    ``keep_inputs`` False: nothing needs a layer's inputs once it has run (no ``on_layer``
    that re-runs the layer or reads ``inputs``: it is given None), so each batch's outputs
    are written over its inputs and the hidden states are held once, not twice (a batch
    runs before its rows are overwritten, and the rows of a batch depend on nothing else:
    the same values). ``hidden_device``: where hidden states live between layers: the
    compute device, "cpu" (batch slices are moved to the device), or None/"auto" (the device
    if the copies held use < 40% of free CUDA memory, else CPU). Returns the last decoder
    layer's output (before the final norm), ``model.dtype`` [rows, seqlen, hidden] on
    ``hidden_device``; pass it to ``model.final_logits`` for logits. Raises InputError on bad
    tokens and on NaN/Inf hidden states (naming the layer).

    ``checkpoint`` (a :class:`quantpress.calibration.checkpoint.LayerCheckpoint`) makes the
    pass resumable: after each layer the hidden states and ``state.layer_state(i)`` are
    committed, and a pass that finds finished layers hands their states to
    ``state.restore(i, saved)``, then ``state.resumed(start)`` if it has it, and starts after
    the last of them (``state``: e.g. a :class:`FanOut` whose consumers implement them)."""
    tokens = torch.as_tensor(tokens)
    if tokens.ndim != 2 or tokens.shape[0] == 0 or tokens.shape[1] == 0:
        raise InputError(f"calibration tokens must be a non-empty [rows, seqlen] tensor, got "
                         f"shape {tuple(tokens.shape)}")
    rows, seqlen = tokens.shape
    bs = batch_size or rows
    hdev = _hidden_device(model, rows, seqlen, hidden_device, 2 if keep_inputs else 1)
    start = 0
    if checkpoint is not None:
        if state is None:
            raise ValueError("a checkpointed pass needs the consumers' state (layer_state / restore)")
        start, saved, states = checkpoint.start()
        for i, st in enumerate(states):
            state.restore(i, st)
        if start and hasattr(state, "resumed"):
            state.resumed(start)
    if start:
        hidden = saved.to(hdev, model.dtype)
        del saved
    else:
        hidden = model.embed(tokens, out_device=hdev, batch_size=bs)
    t_first = time.perf_counter()
    for i, layer in model.layers(progress, start):
        ctx = LayerContext(model, i, bs, hdev, check_finite)
        handle = hooks_factory(i, layer) if hooks_factory is not None else None
        try:
            outputs = ctx.forward(layer, hidden, out=None if keep_inputs else hidden)
        finally:
            _remove(handle)
        if on_layer is not None:
            replaced = on_layer(i, layer, hidden if keep_inputs else None, outputs, ctx)
            if replaced is not None:
                if replaced.shape != outputs.shape:
                    raise ValueError(f"on_layer({i}) returned shape {tuple(replaced.shape)}, "
                                     f"expected {tuple(outputs.shape)}")
                outputs = replaced.to(hdev, model.dtype)
        del hidden, layer
        hidden = outputs
        if checkpoint is not None:
            checkpoint.commit(i, hidden, state.layer_state(i))
        if progress and i == start and model.num_layers - start > 1:
            from tqdm.auto import tqdm

            tqdm.write(estimate_line(rows, seqlen, model.num_layers - start, time.perf_counter() - t_first),
                       file=sys.stderr)
    return hidden


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 120:
        return f"{max(seconds, 0.0):.0f} s"
    if s < 7200:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s // 60 % 60:02d} min"


def estimate_line(rows: int, seqlen: int, layers: int, first_seconds: float) -> str:
    """The one-line estimate a streamed pass prints after its first layer: ``rows`` ×
    ``seqlen`` tokens through ``layers`` decoder layers (those left, the first included) at the
    rate of the first one (``first_seconds``, wall seconds, loading and the consumers' work
    included), in the form ``estimate: ROWS rows x SEQLEN tokens x LAYERS layers: the first
    took SECONDS s (RATE tokens/s), about H h MM min for the pass``. The progress bar's
    remaining time updates it as layers finish."""
    tokens = rows * seqlen
    rate = tokens / max(first_seconds, 1e-9)
    return (f"estimate: {rows} rows x {seqlen} tokens x {layers} layers: the first took "
            f"{first_seconds:.1f} s ({rate:,.0f} tokens/s), about "
            f"{_duration(first_seconds * layers)} for the pass")


def _remove(handle) -> None:
    if handle is None:
        return
    if isinstance(handle, (list, tuple)):
        for h in handle:
            h.remove()
    else:
        handle.remove()


# --------------------------------------------------------------------------------------------
# Several consumers of one reference pass

def side_by_side_threads(device: torch.device | str, consumers: int) -> int:
    """How many consumers of a shared pass :class:`FanOut` runs at once on ``device``: on CPU,
    when torch runs its ops on one intra-op thread (``OMP_NUM_THREADS=1``, as in a Ray task
    given one CPU) and the process may use more cores, up to that many consumers, each on one
    core; otherwise 1 (in order: torch's own threads already use the cores, and a second
    thread would make them fight). Every op of a consumer runs on one intra-op thread either
    way, so what it computes does not depend on this."""
    if torch.device(device).type != "cpu" or consumers < 2 or torch.get_num_threads() != 1:
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(consumers, cores))


def run_side_by_side(calls: list[Callable[[], None]], threads: int) -> list[BaseException | None]:
    """Run the ``calls`` in ``threads`` Python threads, each under ``torch.no_grad()`` (grad
    mode is per thread) with one torch intra-op thread; returns, per call, the exception that
    stopped it or None, once every call has stopped."""
    from concurrent.futures import ThreadPoolExecutor

    def one(f: Callable[[], None]) -> None:
        with torch.no_grad():
            f()

    with ThreadPoolExecutor(max(1, min(threads, len(calls))), initializer=torch.set_num_threads,
                            initargs=(1,)) as pool:
        futures = [pool.submit(one, f) for f in calls]
    return [f.exception() for f in futures]


def raise_first(errors: list[BaseException | None]) -> None:
    """Raise the first error of :func:`run_side_by_side`'s list, if any."""
    for e in errors:
        if e is not None:
            raise e


def private_parameters(layer: nn.Module) -> nn.Module:
    """A copy of ``layer`` whose parameters are new ``nn.Parameter`` objects over the same
    storage (no weight is copied; buffers and the config are shared): a consumer may swap
    ``weight.data`` of its copy (the AWQ grid, the measurement's candidates) while another
    consumer reads the original."""
    memo = {id(p): nn.Parameter(p.data, requires_grad=p.requires_grad) for p in layer.parameters()}
    memo.update({id(b): b for b in layer.buffers()})
    cfg = getattr(layer, "config", None)
    if cfg is not None:
        memo[id(cfg)] = cfg
    return copy.deepcopy(layer, memo)


def _param_ids(layer: nn.Module) -> dict:
    return {k: (p.data_ptr(), p.dtype, tuple(p.shape)) for k, p in layer.named_parameters()}


class FanOut:
    """Several consumers of one streamed pass over the reference (unquantized) hidden states:
    each consumer is an object with optional ``hooks(index, layer)`` (capture hooks, as a
    ``hooks_factory``) and ``on_layer(index, layer, inputs, outputs, ctx)``. Pass
    :meth:`hooks` and :meth:`on_layer` to :func:`run`: every consumer's hooks see the same
    forward of each layer, then the consumers' ``on_layer`` run, in order or side by side
    (``threads``, default :func:`side_by_side_threads`: on CPU with one intra-op thread, one
    consumer per free core, each given its own :func:`private_parameters` copy of the layer;
    a consumer marked ``after_all`` runs alone once the others are done).

    Consumers of a shared pass must leave what the others read as they found it: the layer's
    parameters (a consumer that swaps weights restores the original tensors), ``inputs`` and
    ``outputs``; their ``on_layer`` must return None (the next layer gets the reference
    output). :meth:`on_layer` checks the return value and that the layer's parameters are the
    same tensors afterwards (ValueError naming the consumer otherwise).

    A consumer with hooks only, or marked ``inputs_unused`` (its ``on_layer`` never reads
    ``inputs``), lets the pass hold the hidden states once (:attr:`keep_inputs`)."""

    def __init__(self, consumers, threads: int | None = None):
        self.consumers = list(consumers)
        self.threads = threads

    @property
    def keep_inputs(self) -> bool:
        """Whether some consumer's ``on_layer`` reads the layer's inputs (:func:`run`'s
        ``keep_inputs``): one has an ``on_layer`` and is not marked ``inputs_unused``."""
        return any(getattr(c, "on_layer", None) is not None and not getattr(c, "inputs_unused", False)
                   for c in self.consumers)

    def hooks(self, index: int, layer: nn.Module) -> list:
        """The consumers' hook handles of layer ``index``, as one list (the engine removes
        them after the layer's forward)."""
        handles = []
        for c in self.consumers:
            f = getattr(c, "hooks", None)
            if f is None:
                continue
            h = f(index, layer)
            if h is None:
                continue
            handles.extend(h if isinstance(h, (list, tuple)) else [h])
        return handles

    def layer_state(self, index: int) -> list:
        """Each consumer's ``layer_state(index)`` (what it gathered on layer ``index``), for a
        checkpointed pass (None for a consumer marked ``stateless``). ValueError when a
        consumer cannot be checkpointed."""
        out = []
        for c in self.consumers:
            f = getattr(c, "layer_state", None)
            if f is None and not getattr(c, "stateless", False):
                raise ValueError(f"{type(c).__name__} cannot be checkpointed (no layer_state)")
            out.append(None if f is None else f(index))
        return out

    def restore(self, index: int, saved: list) -> None:
        """Hand each consumer its saved state of layer ``index`` (a resumed pass)."""
        if len(saved) != len(self.consumers):
            raise ValueError(f"saved state of layer {index} holds {len(saved)} consumers, the pass "
                             f"has {len(self.consumers)}")
        for c, st in zip(self.consumers, saved):
            f = getattr(c, "restore", None)
            if f is not None:
                f(index, st)

    def resumed(self, start: int) -> None:
        """Tell the consumers that have ``resumed(start)`` that every saved layer state was
        restored and the pass goes on at layer ``start`` (a writer adopts its parts there)."""
        for c in self.consumers:
            f = getattr(c, "resumed", None)
            if f is not None:
                f(start)

    def on_layer(self, index: int, layer: nn.Module, inputs: torch.Tensor, outputs: torch.Tensor,
                 ctx: LayerContext) -> None:
        """Each consumer's ``on_layer`` (side by side when :attr:`threads` allows, the first
        error raised in consumer order), then the ``after_all`` ones; returns None."""
        calls = [c for c in self.consumers if getattr(c, "on_layer", None) is not None]
        together = [c for c in calls if not getattr(c, "after_all", False)]
        threads = self.threads if self.threads is not None else side_by_side_threads(ctx.model.device, len(together))
        if threads > 1 and len(together) > 1:
            raise_first(run_side_by_side(
                [functools.partial(self._call, c, index, private_parameters(layer), inputs, outputs, ctx)
                 for c in together], threads))
        else:
            for c in together:
                self._call(c, index, layer, inputs, outputs, ctx)
        for c in calls:
            if getattr(c, "after_all", False):
                self._call(c, index, layer, inputs, outputs, ctx)
        return None

    @staticmethod
    def _call(c, index: int, layer: nn.Module, inputs: torch.Tensor, outputs: torch.Tensor,
              ctx: LayerContext) -> None:
        params = _param_ids(layer)
        if c.on_layer(index, layer, inputs, outputs, ctx) is not None:
            raise ValueError(f"{type(c).__name__}.on_layer returned hidden states in a shared "
                             f"reference pass")
        now = _param_ids(layer)
        if now != params:
            changed = sorted(k for k in params if now.get(k) != params[k])
            raise ValueError(f"{type(c).__name__}.on_layer left decoder layer {index}'s "
                             f"parameters {changed[:3]} changed in a shared reference pass")
