"""Activation statistics of ``nn.Linear`` inputs, captured by forward hooks.

Per linear layer (input width ``K``), accumulated over every token of every row and batch:

=============  ==========================  ====================================================
statistic      storage                     use / source reproduced
=============  ==========================  ====================================================
``count``      int (tokens seen)           n in every mean below; llama.cpp imatrix ``counts``
``abs_sum``    float64 [K]                 Σ|x|: AWQ ``x_mean = mean |x|`` (AutoAWQ
                                           ``get_act_scale`` / ``_search_best_scale``)
``sq_sum``     float64 [K]                 Σx²: llama.cpp imatrix ``in_sum2``
                                           (``IMatrixCollector::collect_imatrix``)
``xtx``        ``hessian_dtype`` [K, K]    ΣxᵀX: GPTQ / exllamav2 Hessian, H = 2/n·XᵀX
``abs_max``    float32 [K]                 max |x| (kind ``amax``, not in the default kinds):
                                           FP8 static ``input_scale`` = max / 448
                                           (llm-compressor ``static_minmax`` observer)
=============  ==========================  ====================================================

Every batch is reduced in float32 on the activations' device (Σ|x|, Σx² and XᵀX of the batch);
the per-channel sums are then added into float64 accumulators, so that millions of tokens add
up without float32 round-off (cost: 2·K doubles). XᵀX of a batch is a float32 matmul, added
into a float32 accumulator by default (as GPTQ and exllamav2 do; [K, K] doubles would need
twice the memory for e.g. K = 14336); pass ``hessian_dtype=torch.float64`` to accumulate in
float64. Non-finite activations raise :class:`~quantize.errors.InputError` naming the linear.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import nn

from quantpress.errors import InputError

ALL_KINDS = frozenset({"abs", "sq", "hessian"})
#: every statistic a collector can be asked for (the default, :data:`ALL_KINDS`, and ``amax``)
KNOWN_KINDS = ALL_KINDS | {"amax"}


@dataclass
class LinearStats:
    """Running input statistics of one linear layer named ``name`` with ``in_features`` = K.

    ``kinds`` ⊆ {"abs", "sq", "hessian", "amax"} selects what is accumulated (the count always
    is).
    Accumulators live on ``device`` (where the activations are)."""

    name: str
    in_features: int
    kinds: frozenset = ALL_KINDS
    device: torch.device | str = "cpu"
    hessian_dtype: torch.dtype = torch.float32
    count: int = 0
    abs_sum: torch.Tensor | None = None
    sq_sum: torch.Tensor | None = None
    xtx: torch.Tensor | None = None
    abs_max: torch.Tensor | None = None
    #: wall seconds spent in :meth:`update` (on CUDA: launching the work, unsynchronized)
    seconds: float = 0.0

    def __post_init__(self):
        unknown = set(self.kinds) - KNOWN_KINDS
        if unknown:
            raise ValueError(f"unknown statistics {sorted(unknown)}; known: {sorted(KNOWN_KINDS)}")
        self.kinds = frozenset(self.kinds)
        k = self.in_features
        if "abs" in self.kinds and self.abs_sum is None:
            self.abs_sum = torch.zeros(k, dtype=torch.float64, device=self.device)
        if "sq" in self.kinds and self.sq_sum is None:
            self.sq_sum = torch.zeros(k, dtype=torch.float64, device=self.device)
        if "hessian" in self.kinds and self.xtx is None:
            self.xtx = torch.zeros(k, k, dtype=self.hessian_dtype, device=self.device)
        if "amax" in self.kinds and self.abs_max is None:
            self.abs_max = torch.zeros(k, dtype=torch.float32, device=self.device)

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        """Add a batch of inputs ``x`` [..., K] (any float dtype, any leading shape; every
        leading index is one token). Raises InputError naming this linear if ``x`` holds NaN or
        Inf (like llama.cpp's "non-finite values detected in <tensor>")."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.name}: input width {x.shape[-1]}, expected {self.in_features}")
        t0 = time.perf_counter()
        x = x.reshape(-1, self.in_features).float()
        if not bool(torch.isfinite(x).all()):
            n_bad = int((~torch.isfinite(x)).sum())
            raise InputError(f"non-finite activations (NaN/Inf) at the input of {self.name}: "
                             f"{n_bad} of {x.numel()} values; the model overflows in this dtype "
                             f"or its weights are corrupt")
        self.count += x.shape[0]
        if self.abs_sum is not None:
            self.abs_sum += x.abs().sum(0, dtype=torch.float32).to(self.abs_sum.device, torch.float64)
        if self.sq_sum is not None:
            self.sq_sum += x.square().sum(0, dtype=torch.float32).to(self.sq_sum.device, torch.float64)
        if self.xtx is not None:
            self.xtx += (x.T @ x).to(self.xtx.device, self.xtx.dtype)
        if self.abs_max is not None:
            torch.maximum(self.abs_max, x.abs().amax(0).to(self.abs_max.device), out=self.abs_max)
        self.seconds += time.perf_counter() - t0

    def _need(self, kind: str, what: str):
        if kind not in self.kinds:
            raise ValueError(f"{self.name}: '{kind}' statistics were not captured (needed for {what})")
        if self.count == 0:
            raise InputError(f"{self.name}: no activations were captured (0 tokens)")

    def abs_mean(self) -> torch.Tensor:
        """Mean |x| per input channel, float32 [K] — AWQ's activation scale ``x_mean``
        (AutoAWQ ``get_act_scale``: ``x.abs().view(-1, K).mean(0)``; AutoAWQ sums in fp32 and
        casts to fp16, which the caller does if it wants the exact fp16 value)."""
        self._need("abs", "abs_mean")
        return (self.abs_sum / self.count).float()

    def sq_mean(self) -> torch.Tensor:
        """Mean x² per input channel, float32 [K] (= in_sum2 / counts; llama-quantize's
        importance weights)."""
        self._need("sq", "sq_mean")
        return (self.sq_sum / self.count).float()

    def imatrix(self) -> tuple[torch.Tensor, int]:
        """llama.cpp imatrix entry of a dense linear: (``in_sum2`` float32 [K] = Σx² over all
        tokens, ``counts`` = number of tokens). In llama.cpp's GGUF imatrix, ``counts`` is a
        [1, n_mat] tensor (one count per expert matrix; n_mat = 1 here)."""
        self._need("sq", "imatrix")
        return self.sq_sum.float(), self.count

    def amax(self) -> torch.Tensor:
        """Largest |x| per input channel over every token seen, float32 [K] (exact: a max of
        the activations as computed); ``.max()`` of it is the per-tensor amax of llm-compressor's
        ``static_minmax`` observer."""
        self._need("amax", "amax")
        return self.abs_max.clone()

    def hessian(self) -> torch.Tensor:
        """GPTQ / exllamav2 Hessian H = 2/n · XᵀX, ``hessian_dtype`` [K, K], n = token count
        (GPTQ ``add_batch`` running average; exllamav2 ``AdaptiveGPTQ.add_batch``)."""
        self._need("hessian", "hessian")
        return self.xtx * (2.0 / self.count)

    def to(self, device) -> "LinearStats":
        """Move the accumulators to ``device`` (in place); returns self."""
        self.device = device
        for a in ("abs_sum", "sq_sum", "xtx", "abs_max"):
            t = getattr(self, a)
            if t is not None:
                setattr(self, a, t.to(device))
        return self


class _Capture:
    """Hook handles of one captured module; ``remove()`` detaches them and, if the collector
    offloads, moves the finished statistics to CPU."""

    def __init__(self, handles, stats: list[LinearStats], offload: bool):
        self._handles, self._stats, self._offload = handles, stats, offload

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._offload:
            for s in self._stats:
                s.to("cpu")


@dataclass
class StatsCollector:
    """Collects :class:`LinearStats` for the ``nn.Linear`` modules of decoder layers.

    Use as ``hooks_factory`` of :func:`calibration.engine.run`: for layer ``i`` it hooks every
    linear of the layer whose name matches ``include`` (substrings; empty = all) under the name
    ``f"{prefix}{i}.{subname}"`` (HF checkpoint names, e.g. ``model.layers.3.mlp.down_proj``).
    Statistics of the same name accumulate across calls (several passes, several batches).
    With ``offload`` (default), finished layers' statistics move to CPU when their hooks are
    removed, so only one layer's accumulators occupy the compute device."""

    kinds: Iterable[str] = ALL_KINDS
    include: tuple[str, ...] = ()
    prefix: str = "model.layers."
    hessian_dtype: torch.dtype = torch.float32
    offload: bool = True
    stats: dict[str, LinearStats] = field(default_factory=dict)

    def __post_init__(self):
        self.kinds = frozenset(self.kinds)

    def attach(self, module: nn.Module, name_prefix: str) -> _Capture:
        """Hook every matching ``nn.Linear`` under ``module``; names are
        ``name_prefix + subname``. Returns a handle whose ``remove()`` detaches the hooks."""
        handles, used = [], []
        for sub, lin in module.named_modules():
            if not isinstance(lin, nn.Linear):
                continue
            if self.include and not any(s in sub for s in self.include):
                continue
            name = name_prefix + sub
            st = self.stats.get(name)
            if st is None:
                st = LinearStats(name, lin.in_features, self.kinds, lin.weight.device,
                                 self.hessian_dtype)
                self.stats[name] = st
            else:
                st.to(lin.weight.device)
            used.append(st)
            handles.append(lin.register_forward_hook(_hook(st)))
        return _Capture(handles, used, self.offload)

    def __call__(self, index: int, layer: nn.Module) -> _Capture:
        """``hooks_factory`` protocol: hook decoder layer ``index``."""
        return self.attach(layer, f"{self.prefix}{index}.")

    def __getitem__(self, name: str) -> LinearStats:
        return self.stats[name]


def _hook(st: LinearStats):
    def fn(module, args, output):
        st.update(args[0])
    return fn
