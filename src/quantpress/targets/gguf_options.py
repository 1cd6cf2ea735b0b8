"""The options of the GGUF target (``convert hf-to-gguf``, ``quantize gguf``, a job file's GGUF
table): :class:`GGUFOptions`, with llama-quantize's names."""
from __future__ import annotations

from dataclasses import dataclass

from quantpress.convert import gguf_policy
from quantpress.errors import InputError
from quantpress.targets.options import option

#: ggml types of an input GGUF that ``quantize gguf`` accepts
FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class GGUFOptions:
    """Options of ``convert hf-to-gguf`` / ``quantize gguf``, with llama-quantize's names.

    ``policy``: a llama.cpp ftype name (F32, F16, BF16, Q8_0, Q4_0 … Q4_K_M … Q6_K, Q2_K_S,
    IQ4_NL, IQ4_XS; :data:`quantpress.convert.gguf_policy.POLICIES`).
    ``imatrix``: an importance-matrix file (GGUF or legacy ``.dat``; ``--imatrix``), None for
    none; ``include_weights`` / ``exclude_weights``: substrings of the imatrix entries to use /
    not use (``--include-weights`` / ``--exclude-weights``, not both).
    ``output_tensor_type``, ``token_embedding_type`` (ggml type names, any case),
    ``leave_output_tensor``, ``pure``, ``tensor_type`` (``"REGEX=TYPE"`` strings, first match
    wins): llama-quantize's per-tensor controls
    (:class:`quantpress.convert.gguf_policy.TypeOverrides`)."""

    policy: str = option("F16", flag="--policy", choices=gguf_policy.POLICIES,
                         help="llama.cpp ftype (default {default})")
    imatrix: str | None = option(None, flag="--imatrix", metavar="FILE|auto",
                                 help="importance matrix for the quantizers: a GGUF imatrix (quantize "
                                      "imatrix, llama-imatrix) or a legacy .dat; 'auto' computes one "
                                      "first with the calibration options below and keeps it as "
                                      "OUTPUT.imatrix.gguf")
    include_weights: tuple[str, ...] = option((), flag="--include-weights", append=True, metavar="NAME",
                                              help="use the imatrix only for tensors whose name "
                                                   "contains NAME (repeatable)")
    exclude_weights: tuple[str, ...] = option((), flag="--exclude-weights", append=True, metavar="NAME",
                                              help="do not use the imatrix for tensors whose name "
                                                   "contains NAME (repeatable)")
    output_tensor_type: str | None = option(None, flag="--output-tensor-type", metavar="TYPE",
                                            help="ggml type of output.weight")
    token_embedding_type: str | None = option(None, flag="--token-embedding-type", metavar="TYPE",
                                              help="ggml type of token_embd.weight")
    leave_output_tensor: bool = option(False, flag="--leave-output-tensor",
                                       help="do not quantize output.weight")
    pure: bool = option(False, flag="--pure", help="the policy's default type for every quantized "
                                                   "tensor (no k-quant mixtures)")
    tensor_type: tuple[str, ...] = option((), flag="--tensor-type", append=True, metavar="PATTERN=TYPE",
                                          help="ggml type for the tensors whose name matches the "
                                               "regular expression PATTERN (repeatable, first match "
                                               "wins), e.g. attn_v=q8_0")

    def validate(self) -> None:
        """InputError for a policy llama.cpp does not have (the message lists them), an
        unknown ggml type or malformed ``--tensor-type`` (llama-quantize's
        ``parse_tensor_type``), a bad regular expression, and include with exclude."""
        if self.policy not in gguf_policy.POLICIES:
            raise InputError(f"--policy {self.policy}: unknown; choose one of "
                             f"{', '.join(gguf_policy.POLICIES)}")
        if self.include_weights and self.exclude_weights:
            raise InputError("--include-weights and --exclude-weights cannot be used together")
        if (self.include_weights or self.exclude_weights) and not self.imatrix:
            raise InputError("--include-weights/--exclude-weights need --imatrix")
        self.overrides()

    def overrides(self) -> gguf_policy.TypeOverrides:
        """The :class:`quantpress.convert.gguf_policy.TypeOverrides` of these options
        (InputError for an unknown type, a malformed ``--tensor-type`` or a bad regex)."""
        import re

        def ty(name: str | None, what: str) -> str | None:
            if name is None:
                return None
            try:
                return gguf_policy.parse_ggml_type(name, what)
            except ValueError as e:
                raise InputError(str(e)) from None
        pairs = []
        for spec in self.tensor_type:
            pat, sep, t = spec.partition("=")
            if not sep or not pat or not t:
                raise InputError(f"--tensor-type {spec}: expected PATTERN=TYPE (e.g. attn_v=q8_0)")
            try:
                re.compile(pat.lower())
            except re.error as e:
                raise InputError(f"--tensor-type {spec}: bad regular expression {pat!r} ({e})") from None
            pairs.append((pat, ty(t, f"--tensor-type {spec}")))
        return gguf_policy.TypeOverrides(
            output_tensor_type=ty(self.output_tensor_type, "--output-tensor-type"),
            token_embedding_type=ty(self.token_embedding_type, "--token-embedding-type"),
            leave_output_tensor=self.leave_output_tensor, pure=self.pure, tensor_types=tuple(pairs))


