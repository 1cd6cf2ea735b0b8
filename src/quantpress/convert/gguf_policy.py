"""Per-tensor ggml type selection of llama-quantize, as a small interpreter over data.

The rules live in ``configs/gguf_policies.toml`` (tensor classes, counters, ordered rules per
policy, the fallback table, the quantizable-tensor filter and convert_hf_to_gguf's float
types). This module only evaluates them; it contains no per-policy logic.

Reproduced llama.cpp source (0c1e57098, as vendored in llama-cpp-python 0.3.36):

* ``src/llama-quant.cpp``: ``llama_model_quantize_impl`` (visiting order and the
  preliminary loop that picks every tensor's type), ``llama_tensor_get_type``,
  ``llama_tensor_get_type_impl``, ``tensor_type_fallback``, ``tensor_allows_quantization``,
  ``tensor_get_category``, ``init_quantize_state_counters``, ``llama_ftype_get_default_type``;
* ``src/llama-model-loader.h``: ``weight_name_comparer`` (the order of ``weights_map``,
  which is both the visiting order that drives the counters and the output tensor order);
* ``src/models/*.cpp``: the ``LLM_TYPE_70B`` size class;
* ``convert_hf_to_gguf.py`` / ``conversion/base.py`` ``prepare_tensors``: the tensor types
  of ``--outtype f32|f16|bf16``.

Evaluation, per policy (``plan_types``):

1. Float policies (``float = true``: F32, F16, BF16) return the converter's choice: F32 for
   1-D tensors, ``*_norm.weight`` and the always-F32 tensors, the outtype otherwise.
2. Quantized policies visit the tensors in ``tensor_order``. A tensor that is not
   quantizable keeps the type it has in the F16 GGUF (the converter's F16 choice). For the
   others: the tensor's class (token_embd becomes output when embeddings are tied), its
   counter (i, n), stage "select" (shared ``[[select]]`` rules, then the policy's rules:
   first match wins, else the default type), stage "adjust" (``[[adjust]]``: first match
   wins, else unchanged), the counter advances, then ``tensor_type_fallback``.

llama-quantize's per-tensor controls (:class:`TypeOverrides`: ``--output-tensor-type``,
``--token-embedding-type``, ``--leave-output-tensor``, ``--pure``, ``--tensor-type``) are
applied as ``llama_tensor_get_type`` does around the rules: the first two return before any
rule (no fallback), ``--leave-output-tensor`` makes output.weight non-quantizable, a
``--tensor-type`` match or ``--pure`` skips the rules (and so does not advance the class
counter), then the fallback. Not modelled: the IQ1/IQ2/IQ3/TQ/MXFP4 ftype branches.
"""
from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Iterable

import gguf

from quantpress.configs import load_toml

CONFIG_NAME = "gguf_policies.toml"

__all__ = ["POLICIES", "ModelParams", "TypeOverrides", "ftype_id", "default_type", "is_float_policy",
           "plan_types", "tensor_order", "is_quantizable", "converter_type", "requires_imatrix",
           "parse_ggml_type"]


@dataclass(frozen=True)
class ModelParams:
    """The model facts the rules read (llama.cpp ``llama_hparams`` / ``llm_arch``).

    ``arch``: gguf architecture name (``general.architecture``); ``n_layer``: block count;
    ``n_head`` / ``n_head_kv``: attention heads (layer 0); ``n_expert``: experts (0 for
    dense models); ``has_output``: whether the model has an untied ``output.weight``
    (otherwise token_embd is tied and follows the output rules, as llama-quantize decides
    from the tensor names); None infers it from the tensor list; ``has_imatrix``: whether an importance matrix is supplied.
    """

    arch: str
    n_layer: int
    n_head: int
    n_head_kv: int
    n_expert: int = 0
    has_output: bool | None = None
    has_imatrix: bool = False

    @property
    def gqa(self) -> int:
        """``llama_hparams::n_gqa``: n_head / n_head_kv (unsigned division), 0 if no KV heads."""
        return 0 if self.n_head_kv == 0 else self.n_head // self.n_head_kv


@dataclass(frozen=True)
class TypeOverrides:
    """llama-quantize's per-tensor controls (``tools/quantize/quantize.cpp`` options, applied
    by ``llama_tensor_get_type`` in ``src/llama-quant.cpp``).

    ``output_tensor_type`` / ``token_embedding_type``: a ggml type name for output.weight /
    token_embd.weight (``--output-tensor-type`` / ``--token-embedding-type``);
    ``leave_output_tensor``: output.weight is not quantized (``--leave-output-tensor``);
    ``pure``: every quantizable tensor gets the policy's default type (``--pure``);
    ``tensor_types``: ((regex, ggml type name), ...) in order, the first pattern found in a
    tensor name (``std::regex_search``, the pattern lower-cased as llama-quantize does)
    gives its type (``--tensor-type PATTERN=TYPE``).
    """

    output_tensor_type: str | None = None
    token_embedding_type: str | None = None
    leave_output_tensor: bool = False
    pure: bool = False
    tensor_types: tuple[tuple[str, str], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.output_tensor_type or self.token_embedding_type or self.leave_output_tensor
                    or self.pure or self.tensor_types)


def parse_ggml_type(name: str, what: str) -> str:
    """A ggml type name matched case-insensitively (llama-quantize ``parse_ggml_type``);
    ValueError naming ``what`` and listing the types quantpress can write otherwise."""
    from quantpress.quantize import ggml

    known = ggml.names()
    for t in known:
        if t.lower() == name.strip().lower():
            return t
    raise ValueError(f"{what}: unknown ggml type {name!r}; choose one of {', '.join(sorted(known))}")


# --------------------------------------------------------------------------- expressions

def _c_div(a: int, b: int) -> int:
    """C integer division: truncates toward zero."""
    if b == 0:
        raise ZeroDivisionError("division by zero in a policy expression")
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _c_mod(a: int, b: int) -> int:
    """C ``%``: the remainder has the sign of the dividend."""
    return a - _c_div(a, b) * b


_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: _c_div, ast.Mod: _c_mod,
}
_CMPOPS: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
}
# variables a rule may read; see the header of configs/gguf_policies.toml
_VARIABLES = frozenset({"i", "n", "ne0", "default", "type", "arch", "n_layer", "n_head",
                        "n_head_kv", "n_expert", "gqa", "imatrix", "llm_type"})
_FUNCTIONS = frozenset({"blck"})

Env = dict[str, Any]
Compiled = Callable[[Env], Any]


class PolicyExpr:
    """One expression of configs/gguf_policies.toml (``when`` conditions, counters), parsed with
    ``ast`` and checked against a whitelisted subset (integers, the names of the env and of the
    named ``conditions``, arithmetic with C's integer division and remainder, comparisons,
    ``and``/``or``/``not``), compiled to a closure; calling it with an env dict evaluates it.
    Raises ValueError naming the expression for anything outside the subset."""

    def __init__(self, source: str, conditions: dict[str, "PolicyExpr"] | None = None):
        self.source = source
        self._conditions = conditions if conditions is not None else {}
        try:
            tree = ast.parse(source, mode="eval")
        except SyntaxError as e:
            raise ValueError(f"policy expression {source!r}: {e.msg}") from None
        self.names: set[str] = set()
        self._fn = self._compile(tree.body)

    def __call__(self, env: Env) -> Any:
        return self._fn(env)

    def _bad(self, node: ast.AST, what: str) -> ValueError:
        return ValueError(f"policy expression {self.source!r}: {what} "
                          f"({type(node).__name__} not allowed)")

    def _compile(self, node: ast.AST) -> Compiled:
        if isinstance(node, ast.BoolOp):
            parts = [self._compile(v) for v in node.values]
            if isinstance(node.op, ast.And):
                return lambda env: all(p(env) for p in parts)
            return lambda env: any(p(env) for p in parts)
        if isinstance(node, ast.UnaryOp):
            arg = self._compile(node.operand)
            if isinstance(node.op, ast.Not):
                return lambda env: not arg(env)
            if isinstance(node.op, ast.USub):
                return lambda env: -arg(env)
            raise self._bad(node.op, "unsupported unary operator")
        if isinstance(node, ast.BinOp):
            op = _BINOPS.get(type(node.op))
            if op is None:
                raise self._bad(node.op, "unsupported operator")
            lhs, rhs = self._compile(node.left), self._compile(node.right)
            return lambda env: op(lhs(env), rhs(env))
        if isinstance(node, ast.Compare):
            ops = []
            for o in node.ops:
                f = _CMPOPS.get(type(o))
                if f is None:
                    raise self._bad(o, "unsupported comparison")
                ops.append(f)
            terms = [self._compile(node.left)] + [self._compile(c) for c in node.comparators]

            def compare(env: Env) -> bool:
                left = terms[0](env)
                for f, t in zip(ops, terms[1:]):
                    right = t(env)
                    if not f(left, right):
                        return False
                    left = right
                return True
            return compare
        if isinstance(node, ast.Constant):
            if not isinstance(node.value, (bool, int, str)):
                raise self._bad(node, "only int, str and bool literals")
            value = node.value
            return lambda env: value
        if isinstance(node, ast.Tuple):
            items = [self._compile(e) for e in node.elts]
            return lambda env: tuple(it(env) for it in items)
        if isinstance(node, ast.Name):
            name = node.id
            if name in self._conditions:
                cond = self._conditions[name]
                self.names |= cond.names
                return lambda env: bool(cond(env))
            if name not in _VARIABLES:
                raise ValueError(f"policy expression {self.source!r}: unknown name {name!r}; "
                                 f"known: {sorted(_VARIABLES | set(self._conditions))}")
            self.names.add(name)

            def read(env: Env) -> Any:
                value = env.get(name)
                if value is None:
                    raise ValueError(f"policy expression {self.source!r} reads {name!r}, "
                                     f"which is not defined for this tensor")
                return value
            return read
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in _FUNCTIONS \
                    or node.keywords or len(node.args) != 1:
                raise self._bad(node, f"only the calls {sorted(_FUNCTIONS)} with one argument")
            arg = self._compile(node.args[0])
            return lambda env: _block_size(arg(env))
        raise self._bad(node, "unsupported syntax")


# --------------------------------------------------------------------------- ggml types

def _block_size(type_name: str) -> int:
    """``ggml_blck_size`` (elements per block) of a ggml type, from gguf-py's table."""
    try:
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]
    except KeyError:
        raise ValueError(f"unknown ggml type {type_name!r}") from None


def _is_quantized(type_name: str) -> bool:
    """``ggml_is_quantized``: every type except the plain float and integer ones."""
    return type_name not in ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64")


def _ggml_n_dims(shape: tuple[int, ...]) -> int:
    """``ggml_n_dims`` for a numpy-order shape: ne[i] == 1 at the end of ne (the start of the
    numpy shape) does not count; at least 1."""
    ne = list(reversed(shape))
    for i in range(len(ne) - 1, 0, -1):
        if ne[i] != 1:
            return i + 1
    return 1


_BLK = re.compile(r"blk\.[ \t\n\v\f\r]*([+-]?\d+)")


def _layer_of(name: str) -> int | None:
    """``sscanf(name, "blk.%d.", &il)``: the block number, or None when nothing converts."""
    m = _BLK.match(name)
    return int(m.group(1)) if m else None


# --------------------------------------------------------------------------- the rule set

@dataclass(frozen=True)
class _Rule:
    classes: frozenset[str]
    when: PolicyExpr | None
    policies: frozenset[str] | None
    type: str  # a ggml type name, "default" or "keep"


@dataclass(frozen=True)
class _Policy:
    name: str
    id: int
    default: str
    is_float: bool
    rules: tuple[_Rule, ...]
    imatrix_types: frozenset[str] = frozenset()


class _RuleSet:
    """The parsed and validated ``gguf_policies.toml``."""

    def __init__(self, cfg: dict):
        if cfg.get("schema") != 1:
            raise ValueError(f"{CONFIG_NAME}: unsupported schema {cfg.get('schema')!r}")
        self.conditions: dict[str, PolicyExpr] = {}
        for name, src in cfg.get("conditions", {}).items():
            if name in _VARIABLES or name in _FUNCTIONS:
                raise ValueError(f"{CONFIG_NAME}: condition {name!r} shadows a built-in name")
            self.conditions[name] = PolicyExpr(src, self.conditions)

        self.llm_types = [(e["name"], PolicyExpr(e["when"], self.conditions))
                          for e in cfg.get("llm_type", [])]

        q = cfg["quantizable"]
        self.q_min_dims: int = q["min_dims"]
        self.q_ends_with: str = q["ends_with"]
        self.q_not_contains: tuple[str, ...] = tuple(q["not_contains"])
        self.q_not_equals: frozenset[str] = frozenset(q["not_equals"])
        self.q_arch_not_contains: dict[str, tuple[str, ...]] = {
            k: tuple(v) for k, v in q.get("arch_not_contains", {}).items()}

        self.classes: list[tuple[str, frozenset[str], tuple[str, ...], str | None]] = []
        for c in cfg["class"]:
            self.classes.append((c["name"], frozenset(c.get("equals", ())),
                                 tuple(c.get("contains", ())), c.get("tied_as")))
        class_names = {c[0] for c in self.classes} | {"other"}

        self.counters: dict[str, tuple[str, PolicyExpr | None]] = {}
        for cls, spec in cfg.get("counter", {}).items():
            if cls not in class_names:
                raise ValueError(f"{CONFIG_NAME}: counter for unknown class {cls!r}")
            if spec["n"] not in ("count", "n_layer"):
                raise ValueError(f"{CONFIG_NAME}: counter {cls}: n must be 'count' or 'n_layer'")
            lfn = spec.get("layer_from_name")
            self.counters[cls] = (spec["n"], PolicyExpr(lfn, self.conditions) if lfn else None)

        fb = cfg["fallback"]
        self.fb_replace: dict[str, str] = dict(fb["replace"])
        self.fb_keep_block: int = fb["keep_if_block_at_most"]
        self.fb_last: str = fb["last_resort"]
        for t in list(self.fb_replace.values()) + [self.fb_last]:
            _block_size(t)

        cv = cfg["converter"]
        self.cv_f32_suffixes: tuple[str, ...] = tuple(cv["f32_suffixes"])
        self.cv_tensor_suffixes: tuple[str, ...] = tuple(cv["tensor_suffixes"])
        self.cv_f32_tensors: tuple[gguf.MODEL_TENSOR, ...] = tuple(
            gguf.MODEL_TENSOR[k] for k in cv["f32_tensors"])

        self.policies: dict[str, _Policy] = {}
        for name, p in cfg["policy"].items():
            _block_size(p["default"])
            is_float = bool(p.get("float", False))
            if is_float == _is_quantized(p["default"]):
                raise ValueError(f"{CONFIG_NAME}: policy {name}: float must be set exactly "
                                 f"when the default type is not quantized")
            rules = tuple(self._rule(r, class_names, f"policy {name}", shared=False)
                          for r in p.get("rules", []))
            needs = frozenset(p.get("requires_imatrix", ()))
            for t in needs:
                _block_size(t)
            self.policies[name] = _Policy(name, int(p["id"]), p["default"], is_float, rules, needs)
        self.select = tuple(self._rule(r, class_names, "select", shared=True)
                            for r in cfg.get("select", []))
        self.adjust = tuple(self._rule(r, class_names, "adjust", shared=True)
                            for r in cfg.get("adjust", []))

    def _rule(self, r: dict, class_names: set[str], where: str, shared: bool) -> _Rule:
        unknown = set(r) - {"match", "when", "type", "policies"}
        if unknown:
            raise ValueError(f"{CONFIG_NAME}: {where}: unknown rule keys {sorted(unknown)}")
        match = r["match"]
        classes = frozenset([match] if isinstance(match, str) else match)
        if not classes <= class_names:
            raise ValueError(f"{CONFIG_NAME}: {where}: unknown classes {sorted(classes - class_names)}")
        when = PolicyExpr(r["when"], self.conditions) if "when" in r else None
        if when is not None and when.names & {"i", "n"}:
            missing = classes - set(self.counters)
            if missing:
                raise ValueError(f"{CONFIG_NAME}: {where}: {when.source!r} reads i/n but "
                                 f"classes {sorted(missing)} have no counter")
        policies = None
        if "policies" in r:
            if not shared:
                raise ValueError(f"{CONFIG_NAME}: {where}: 'policies' only on shared rules")
            policies = frozenset(r["policies"])
        if r["type"] not in ("default", "keep"):
            _block_size(r["type"])
        return _Rule(classes, when, policies, r["type"])

    # ---- queries

    def policy(self, name: str) -> _Policy:
        try:
            return self.policies[name]
        except KeyError:
            raise ValueError(f"unknown GGUF policy {name!r}; valid policies: "
                             f"{', '.join(self.policies)}") from None

    def classify(self, name: str) -> tuple[str, str | None]:
        """(class, tied_as) of a tensor name (``tensor_get_category``)."""
        for cls, equals, contains, tied_as in self.classes:
            if name in equals or any(s in name for s in contains):
                return cls, tied_as
        return "other", None

    def quantizable(self, name: str, shape: tuple[int, ...], arch: str, leave_output: bool = False) -> bool:
        """``tensor_allows_quantization`` (``quantize_output_tensor = !leave_output``)."""
        if _ggml_n_dims(shape) < self.q_min_dims:
            return False
        if leave_output and name == "output.weight":
            return False
        if not name.endswith(self.q_ends_with) or name in self.q_not_equals:
            return False
        if any(s in name for s in self.q_not_contains):
            return False
        return not any(s in name for s in self.q_arch_not_contains.get(arch, ()))

    def converter_type(self, name: str, shape: tuple[int, ...], arch: str, outtype: str) -> str:
        """convert_hf_to_gguf.py's type for ``--outtype`` F32/F16/BF16 (``prepare_tensors``)."""
        if len(shape) <= 1 or name.endswith(self.cv_f32_suffixes):
            return "F32"
        if name[-7:] not in self.cv_tensor_suffixes or _is_converter_f32(self, name, arch):
            return "F32"
        return outtype

    def llm_type(self, env: Env) -> str:
        for name, cond in self.llm_types:
            if cond(env):
                return name
        return ""


def _is_converter_f32(rs: _RuleSet, name: str, arch: str) -> bool:
    """``ModelBase.match_model_tensor_name`` against the always-F32 tensor keys. The block id
    is the first all-digit component of the name (the converter reads it from the HF name,
    whose layer number is the same). Unknown architectures skip the per-arch filter."""
    bid = next((int(p) for p in name.split(".") if p.isdecimal()), None)
    arch_tensors = _arch_tensors(arch)
    for key in rs.cv_f32_tensors:
        if arch_tensors is not None and key not in arch_tensors:
            continue
        template = gguf.TENSOR_NAMES[key]
        if "{bid}" in template:
            if bid is None:
                continue
            template = template.format(bid=bid)
        elif bid is not None:
            continue
        if name == template + ".weight":
            return True
    return False


@lru_cache(maxsize=None)
def _arch_tensors(arch: str) -> frozenset | None:
    for a, n in gguf.MODEL_ARCH_NAMES.items():
        if n == arch:
            return frozenset(gguf.MODEL_TENSORS.get(a, ()))
    return None


@lru_cache(maxsize=1)
def _rules() -> _RuleSet:
    return _RuleSet(load_toml(CONFIG_NAME))


POLICIES: list[str] = list(_rules().policies)


# --------------------------------------------------------------------------- public API

def ftype_id(policy: str) -> int:
    """The llama_ftype of ``policy`` (the value of ``general.file_type``)."""
    return _rules().policy(policy).id


def default_type(policy: str) -> str:
    """``llama_ftype_get_default_type``: the ggml type most tensors of ``policy`` get."""
    return _rules().policy(policy).default


def is_float_policy(policy: str) -> bool:
    """True for F32/F16/BF16 (types chosen as convert_hf_to_gguf --outtype does)."""
    return _rules().policy(policy).is_float


def tensor_order(names: Iterable[str]) -> list[str]:
    """llama-quantize's visiting and output order (``weight_name_comparer``): tensors outside
    ``blk.N.`` first (layer -1), then by block number, ties by byte-wise name comparison."""
    def key(name: str) -> tuple[int, bytes]:
        layer = _layer_of(name)
        return (-1 if layer is None else layer, name.encode("utf-8"))
    return sorted(names, key=key)


def is_quantizable(name: str, shape: tuple[int, ...], arch: str = "") -> bool:
    """Whether llama-quantize quantizes this tensor at all (``tensor_allows_quantization``).
    ``shape`` is in numpy order."""
    return _rules().quantizable(name, tuple(shape), arch)


def converter_type(name: str, shape: tuple[int, ...], arch: str, outtype: str) -> str:
    """The type convert_hf_to_gguf.py gives a tensor for ``--outtype`` ``outtype`` in
    {"F32", "F16", "BF16"}. ``shape`` is in numpy order."""
    if outtype not in ("F32", "F16", "BF16"):
        raise ValueError(f"outtype must be F32, F16 or BF16, not {outtype!r}")
    return _rules().converter_type(name, tuple(shape), arch, outtype)


def plan_types(policy: str, tensors: list[tuple[str, tuple[int, ...]]],
               params: ModelParams, overrides: TypeOverrides | None = None) -> dict[str, str]:
    """gguf tensor name -> ggml type name that ``policy`` gives every tensor.

    ``tensors``: (gguf name, shape in numpy order, last axis = ggml ne[0]) in any order;
    ``params``: the model facts; ``overrides``: llama-quantize's per-tensor controls
    (:class:`TypeOverrides`, ignored by the float policies). Float policies follow
    convert_hf_to_gguf.py (``prepare_tensors``); quantized policies follow llama-quantize on
    the F16 GGUF that convert_hf_to_gguf.py writes (``llama_model_quantize_impl``'s
    preliminary loop: ``llama_tensor_get_type`` per tensor in ``weight_name_comparer`` order,
    counters from ``init_quantize_state_counters``, ``tensor_type_fallback`` last).
    Raises ValueError for an unknown policy, a tensor listed twice or a bad override regex.
    """
    rs = _rules()
    pol = rs.policy(policy)
    ov = overrides or TypeOverrides()
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in tensors:
        if name in shapes:
            raise ValueError(f"tensor {name!r} listed twice")
        shapes[name] = tuple(int(d) for d in shape)

    if pol.is_float:
        return {name: rs.converter_type(name, shape, params.arch, pol.default)
                for name, shape in shapes.items()}

    patterns = []
    for pat, t in ov.tensor_types:
        try:
            patterns.append((re.compile(pat.lower()), t))
        except re.error as e:
            raise ValueError(f"--tensor-type {pat}={t}: bad regular expression ({e})") from None

    order = tensor_order(shapes)
    classes = {name: rs.classify(name) for name in order}
    if params.has_output is False and "output.weight" in shapes:
        raise ValueError("has_output=False but the tensor list has output.weight")
    tied = not (params.has_output or "output.weight" in shapes)

    base_env: Env = {
        "default": pol.default, "arch": params.arch, "n_layer": params.n_layer,
        "n_head": params.n_head, "n_head_kv": params.n_head_kv, "n_expert": params.n_expert,
        "gqa": params.gqa, "imatrix": bool(params.has_imatrix),
    }
    base_env["llm_type"] = rs.llm_type(base_env)

    # init_quantize_state_counters: totals over every tensor of the model
    totals: dict[str, int] = {}
    for cls, (n_kind, _) in rs.counters.items():
        totals[cls] = (sum(1 for c, _ in classes.values() if c == cls) if n_kind == "count"
                       else params.n_layer)
    running = {cls: 0 for cls in rs.counters}

    out: dict[str, str] = {}
    for name in order:
        shape = shapes[name]
        if not rs.quantizable(name, shape, params.arch, ov.leave_output_tensor):
            out[name] = rs.converter_type(name, shape, params.arch, "F16")
            continue
        cls, tied_as = classes[name]
        # llama_tensor_get_type: the two per-category types return before anything else
        if ov.token_embedding_type and cls == "token_embd":
            out[name] = ov.token_embedding_type
            continue
        if ov.output_tensor_type and cls == "output":
            out[name] = ov.output_tensor_type
            continue
        manual = next((t for rx, t in patterns if rx.search(name)), None)
        ne0 = shape[-1]
        if manual is not None or ov.pure:
            new = manual or pol.default
        else:
            rule_cls = tied_as if (tied and tied_as) else cls
            if ov.output_tensor_type and rule_cls == "output":
                # llama_tensor_get_type_impl: tied token_embd takes --output-tensor-type
                new = ov.output_tensor_type
            else:
                new = _rule_type(rs, pol, name, cls, rule_cls, base_env, totals, running, ne0)
            if cls in running:
                running[cls] += 1
        out[name] = _fallback(rs, new, ne0)
    return out


def _rule_type(rs: _RuleSet, pol: _Policy, name: str, cls: str, rule_cls: str, base_env: Env,
               totals: dict[str, int], running: dict[str, int], ne0: int) -> str:
    """``llama_tensor_get_type_impl`` for one tensor: the select then adjust chains."""
    env = dict(base_env, ne0=ne0, i=None, n=None, type=None)
    if cls in rs.counters:
        env["n"] = totals[cls]
        env["i"] = running[cls]
        layer_when = rs.counters[cls][1]
        if layer_when is not None and layer_when(env):
            layer = _layer_of(name)
            if layer is None:
                raise ValueError(f"failed to determine the layer of tensor {name!r}")
            if not 0 <= layer < env["n"]:
                raise ValueError(f"bad layer {layer} for tensor {name!r}: "
                                 f"must be in [0, {env['n']})")
            env["i"] = layer
    new = _first(rs.select + pol.rules, rule_cls, pol, env, pol.default)
    env["type"] = new
    return _first(rs.adjust, rule_cls, pol, env, new)


def requires_imatrix(policy: str, name: str, type_name: str) -> bool:
    """``tensor_requires_imatrix``: whether llama-quantize refuses to write tensor ``name`` as
    ``type_name`` in a ``policy`` file without importance weights (Q2_K in Q2_K_S files;
    never token_embd / output.weight)."""
    if name in ("token_embd.weight", "per_layer_token_embd.weight", "output.weight"):
        return False
    return type_name in _rules().policy(policy).imatrix_types


def _first(rules: tuple[_Rule, ...], cls: str, pol: _Policy, env: Env, otherwise: str) -> str:
    """First rule of the chain that applies to ``cls`` under ``pol`` and ``env``."""
    for r in rules:
        if cls not in r.classes or (r.policies is not None and pol.name not in r.policies):
            continue
        if r.when is None or r.when(env):
            if r.type == "default":
                return pol.default
            if r.type == "keep":
                return otherwise
            return r.type
    return otherwise


def _fallback(rs: _RuleSet, target: str, ne0: int) -> str:
    """``tensor_type_fallback``: a compatible type when ne0 is not a multiple of the block."""
    blck = _block_size(target)
    if ne0 % blck == 0:
        return target
    new = rs.fb_replace.get(target)
    if new is None:
        if blck > rs.fb_keep_block:
            raise ValueError(f"no tensor type fallback is defined for type {target}")
        new = target
    if ne0 % _block_size(new) != 0:
        new = rs.fb_last
    return new
