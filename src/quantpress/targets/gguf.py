"""GGUF files: ``convert hf-to-gguf`` (an HF directory) and ``quantize gguf`` (requantizing an
F32/F16/BF16 GGUF, llama-quantize's job), one target for both.

The plan is the tensor list (name, shape, a loader), the metadata and one ggml type per
tensor (:func:`quantpress.convert.gguf_policy.plan_types`, llama.cpp's
``llama_tensor_get_type``); tensors are then read, quantized and written one at a time
(:func:`quantpress.convert.gguf_file.write_gguf_many`) while the round trip re-reads each
tensor from the file with gguf-py beside the writing
(:func:`quantpress.convert.gguf_roundtrip.watch_round_trip`). Several policies of one source
are written together from one read of each source tensor per tensor order
(:meth:`GGUFTarget.write_together`).

- From an HF directory the bytes equal ``convert_hf_to_gguf.py --outtype f16`` followed by
  ``llama-quantize`` (llama.cpp as vendored in llama-cpp-python 0.3.36).
- From a GGUF file the KVs are copied in order, then ``general.quantization_version`` and
  ``general.file_type`` are appended last (llama-quantize's remove-then-append:
  ``llama_model_quantize_impl`` ``gguf_set_kv`` + ``gguf_set_val_u32``), tensors come out in
  llama-quantize's order (``weight_name_comparer``) with its types and bytes; an already
  quantized tensor is refused, as llama-quantize does without ``--allow-requantize``.
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from pathlib import Path

from quantpress.convert import gguf_arch, gguf_load, gguf_policy
from quantpress.convert.gguf_ahead import PlanChanged
from quantpress.convert.gguf_file import codecs_leave_a_core, write_gguf_many
from quantpress.convert.gguf_checks import RoundTrip
from quantpress.convert.gguf_roundtrip import start_checkers
from quantpress.errors import InputError, RoundTripError
from quantpress.quantize import ggml
from quantpress.quantize.ggml import compiled_searches
from quantpress.quantize.ggml.processes import start_codec_processes
from quantpress.memory import bound_heap
from quantpress.targets.base import Run, Summary, Target, check_output
from quantpress.targets.gguf_options import FLOAT_TYPES, GGUFOptions
from quantpress.targets.gguf_plan import GGUFPlan, plan_from_gguf, plan_from_hf
from quantpress.targets.imatrix import ImatrixOptions
from quantpress.targets.options import from_table
from quantpress.targets.registry import Estimate, Needs, Step, Verb

__all__ = ["FLOAT_TYPES", "GGUFOptions", "GGUFPlan", "GGUFTarget", "plan_from_gguf", "plan_from_hf"]

#: convert hf-to-gguf computes the metadata (transformers' config and tokenizer) in a forked
#: process while the writer quantizes the first tensors (:func:`plan_from_hf`'s ``overlap``);
#: False: before any tensor, in this process. Overlapping made the whole command faster for
#: SmolLM2's Q4_K_M (more so with its imatrix) and for the 554M random llama (figures and
#: the command in docs/benchmarks.md, "Figures behind the code", ``targets/gguf.py``)
OVERLAP_METADATA = True


#: ``GGUFOptions.imatrix`` asking for the model's own importance matrix, made first
#: (``--imatrix auto``; ``imatrix = true`` in a job file's GGUF table)
AUTO_IMATRIX = "auto"

_REPORT = "also write the summary with every tensor's round-trip figures (RMSE, max error, SNR) as JSON"


def check_gguf_file(path: str) -> None:
    """``quantize gguf``'s input: InputError unless ``path`` is a file."""
    if not Path(path).is_file():
        raise InputError(f"{path}: no such file (quantize gguf reads a .gguf file; "
                         f"'convert hf-to-gguf' reads Hugging Face directories)")


def check_not_gguf(path: str) -> None:
    """``convert hf-to-gguf``'s input: InputError for a GGUF file."""
    if gguf_load.is_gguf(Path(path)):
        raise InputError(f"{path}: a GGUF file; 'quantize gguf' requantizes GGUF files, "
                         f"hf-to-gguf reads Hugging Face directories")


def gguf_steps(args, options: GGUFOptions) -> list[Step]:
    """The steps of ``convert hf-to-gguf`` / ``quantize gguf``: the GGUF at ``-o``; with
    ``--imatrix auto`` first the importance matrix (``quantize imatrix`` with the calibration
    options, kept as ``OUT.imatrix.gguf``, its summary on stderr), the options checked and the
    output path refused before it is made."""
    out = Path(args.output)
    steps = []
    if options.imatrix == AUTO_IMATRIX:
        im_out = out.with_name(out.name + ".imatrix.gguf")
        options = dataclasses.replace(options, imatrix=str(im_out))
        options.validate()
        check_output(out, False, args.force)
        steps.append(Step(ImatrixOptions(), im_out, aside=True))
    return steps + [Step(options, out, calibrated=False, report=args.report)]


class GGUFTarget(Target, kind="gguf", options=GGUFOptions):
    """A GGUF file from an HF directory or an F32/F16/BF16 GGUF (:class:`GGUFOptions`)."""

    #: the round trip runs beside the writing (:meth:`write_together`); verify only reports it
    verify_stage = "verify (beside writing)"
    verbs = (Verb("convert", "hf-to-gguf", "Hugging Face FP16/BF16 directory -> verified GGUF file",
                  arg="model_dir", arg_help="Hugging Face model directory (config.json, safetensors, "
                                            "tokenizer)",
                  out_help="output .gguf path", report=_REPORT, check_input=check_not_gguf, steps=gguf_steps),
             Verb("quantize", "gguf", "requantize an F32/F16/BF16 GGUF with a llama.cpp policy",
                  input="gguf", arg="input", arg_help="input .gguf (F32/F16/BF16 tensors)",
                  out_help="output .gguf path", report=_REPORT, check_input=check_gguf_file,
                  steps=gguf_steps,
                  overrides={"policy": {"required": True, "help": "llama.cpp ftype, e.g. Q4_K_M"}}))
    job_key = "gguf"
    job_order = 10
    runtimes = "llama.cpp, Ollama, LM Studio"
    packages = ("gguf",)
    stream = "tensors"
    memory_stages = ("gguf",)
    needs = Needs(ImatrixOptions, "imatrix", "the imatrix", when=lambda o: o.imatrix == AUTO_IMATRIX)

    @classmethod
    def job_entries(cls, value, where: str, base: Path) -> list[GGUFOptions]:
        """Policy names, or tables of ``convert hf-to-gguf``'s options where ``imatrix`` is
        true (the model's own imatrix, :data:`AUTO_IMATRIX`), false, or the path of an
        imatrix file (relative: to the job file)."""
        if not isinstance(value, list) or not all(isinstance(v, (str, dict)) for v in value):
            raise InputError(f"{where}: {cls.job_key} = {value!r}: expected a list of policy names "
                             f"or tables of hf-to-gguf options")
        out = []
        for i, item in enumerate(value):
            at = f"{where}: {cls.job_key}[{i}]"
            table = {"policy": item} if isinstance(item, str) else dict(item)
            im = table.get("imatrix")
            if isinstance(im, bool):
                if im:
                    table["imatrix"] = AUTO_IMATRIX
                else:
                    del table["imatrix"]
            elif isinstance(im, str):
                f = Path(im).expanduser()
                f = f if f.is_absolute() else (base / f).resolve()
                if im == AUTO_IMATRIX or not f.is_file():
                    raise InputError(f"{at}: imatrix = {im!r}: expected true (this model's imatrix) "
                                     f"or the path of an imatrix file")
                table["imatrix"] = str(f)
            out.append(from_table(GGUFOptions, table, at))
        return out

    @classmethod
    def job_target(cls, options: GGUFOptions) -> str:
        return options.policy

    @classmethod
    def job_path(cls, name: str, options: GGUFOptions) -> str:
        return f"{name}-{options.policy}.gguf"

    @classmethod
    def describe(cls, options: list[GGUFOptions], waiting: bool = False) -> str:
        return ("GGUF policies with the model's imatrix, once it is made" if waiting
                else "GGUF policies from one read of each tensor")

    @classmethod
    def estimate(cls, info, options: list[GGUFOptions]) -> Estimate:
        """Per policy the planned types' bytes (F16 when the plan fails); working memory: the
        largest tensor in float32, its quantized bytes per policy, and the round trip's float32
        chunks (``convert.gguf_checks.VERIFY_CHUNK_ELEMENTS``, four copies)."""
        from quantpress.convert.gguf_checks import VERIFY_CHUNK_ELEMENTS

        cfg, shapes, numel = info.cfg, info.shapes, info.numel
        sizes, out = [], 0
        for o in options:
            try:
                arch = gguf_arch.gguf_arch(cfg)
                names = [(gguf_arch.gguf_tensor_name(k, arch, n_layers=info.layers), s)
                         for k, s in shapes.items() if not gguf_arch.is_skipped_tensor(k)]
                params = gguf_policy.ModelParams(
                    arch=arch, n_layer=info.layers, n_head=info.heads,
                    n_head_kv=int(cfg.get("num_key_value_heads") or info.heads),
                    n_expert=0, has_output=any(n == "output.weight" for n, _ in names))
                types = gguf_policy.plan_types(o.policy, names, params)
                row_bytes = {n: math.prod(s[:-1]) * ggml.get(types[n]).row_bytes(s[-1]) for n, s in names}
                sizes.append(sum(row_bytes.values()))
                out += max(row_bytes.values())
            except Exception:  # an estimate only: fall back to F16 size
                sizes.append(2 * info.total)
                out += 2 * max(numel.values())
        biggest = max(numel.values())
        return Estimate(sizes, {"gguf": 4 * biggest + out + 4 * 4 * VERIFY_CHUNK_ELEMENTS} if options else {})

    def prepare(self, run: Run) -> None:
        with run.stage("prepare"):
            self.device = self.source.device
            bound_heap()                    # before the checkers are forked: they inherit it
            start_checkers(self.device)     # the round trip's processes start while the plan is made
            p, o = self.source.path, self.options
            # from an HF directory transformers' config and tokenizer are read in a forked
            # process while the writer quantizes the first tensors (plan_from_hf's overlap)
            self.plan = plan = (plan_from_gguf(p, o.policy, o) if p.is_file()
                                else plan_from_hf(p, o.policy, o, overlap=OVERLAP_METADATA,
                                                  repo_id=self.source.repo_id))
            if self.device.type == "cpu" and compiled_searches.worth_it(
                    (plan.types[t.name], t.numel, t.name in plan.imatrix) for t in plan.tensors):
                # many K-quant weights: the searches' steps as compiled loops, compiled (or
                # loaded) before the codec processes are forked, which inherit them
                compiled_searches.enable()
                compiled_searches.warm_up(mad=any(plan.types[t.name] == "Q2_K" and t.name not in plan.imatrix
                                                  for t in plan.tensors))
            if self.device.type == "cpu" and not codecs_leave_a_core(
                    [(None, plan.kvs, plan.types, plan.imatrix)], plan.tensors):
                start_codec_processes()     # the search codecs' slices beside this thread's

    def write(self, tmp: Path, run: Run) -> None:
        self.write_together([self], [tmp], [run])

    @classmethod
    def write_together(cls, targets: list["GGUFTarget"], tmps: list[Path], runs: list[Run]) -> None:
        """Write the files of several prepared GGUF targets of one source, ``targets[i]`` at
        ``tmps[i]`` (no rename, no round trip), each byte-identical to its :meth:`write`.

        Targets are grouped by their plan's tensor order (the tuple of tensor names: the
        converter's for the float policies, llama-quantize's ``weight_name_comparer`` order
        for the quantized ones, :func:`_in_quantize_order`), groups in order of first
        appearance; each group is one :func:`quantpress.convert.gguf_file.write_gguf_many`
        over the loaders of its first target, so each source tensor is read once per group
        and encoded once per distinct ggml type. Stage "quantize+write", one progress bar
        over every tensor of every group, labelled with the policies joined by "+", timed in
        ``runs[0]`` and added to the other runs (the targets share it). Each file's round
        trip runs beside the writing (``write_gguf_many(verify=True)``, checking each tensor
        against the source tensor just read); :meth:`verify` then reports it, and each run
        gets the round trip's checking seconds (wall time) as stage :attr:`verify_stage`, the stage
        :meth:`verify`'s report is then timed in too. A group whose plans came from
        ``config.json`` as it is and which transformers' config changes (``PlanChanged``,
        :func:`plan_from_hf` with ``overlap``; nothing is written then) is planned again
        without the overlap and written.

        Raises ValueError when the lists differ in length or are empty, a target is not
        prepared, the targets are not of one source path, or the plans of a group differ in
        architecture or tensor shapes; InputError as ``write_gguf_many`` (a tensor with
        NaN/Inf or of the wrong shape, naming it). Files already begun are closed, not removed.
        """
        targets, tmps = list(targets), [Path(t) for t in tmps]
        if not targets or len(targets) != len(tmps) or len(runs) != len(targets):
            raise ValueError(f"write_together: {len(targets)} targets for {len(tmps)} paths "
                             f"and {len(runs)} runs")
        for t in targets:
            if getattr(t, "plan", None) is None:
                raise ValueError(f"write_together: the {t.options.policy} target is not prepared")
        src = targets[0].source.path.resolve()
        for t in targets[1:]:
            if t.source.path.resolve() != src:
                raise ValueError(f"write_together: targets of different sources "
                                 f"({targets[0].source.path}, {t.source.path})")
        groups: dict[tuple[str, ...], list[int]] = {}
        for i, t in enumerate(targets):
            groups.setdefault(tuple(st.name for st in t.plan.tensors), []).append(i)
        for idx in groups.values():
            first = targets[idx[0]].plan
            shapes = [tuple(st.shape) for st in first.tensors]
            for i in idx[1:]:
                pl = targets[i].plan
                if pl.arch != first.arch:
                    raise ValueError(f"write_together: architecture {pl.arch} of "
                                     f"{targets[i].options.policy}, {first.arch} of "
                                     f"{targets[idx[0]].options.policy}")
                for st, shape in zip(pl.tensors, shapes):
                    if tuple(st.shape) != shape:
                        raise ValueError(f"write_together: tensor '{st.name}' is {tuple(st.shape)} "
                                         f"in {targets[i].options.policy}, {shape} in "
                                         f"{targets[idx[0]].options.policy}")
        label = "+".join(t.options.policy for t in targets)
        total = sum(len(targets[idx[0]].plan.tensors) for idx in groups.values())
        run = runs[0]
        before = run.stages.get("quantize+write", 0.0)
        with run.stage("quantize+write"):
            bar = run.bar(None, label, "tensor", total=total)

            def progress(it):
                for x in it:
                    yield x
                    bar.update(1)
            try:
                for idx in groups.values():
                    try:
                        trips = cls._write_group([targets[i] for i in idx], [tmps[i] for i in idx], progress)
                    except PlanChanged:
                        # transformers' config gave the tensors another plan than config.json
                        # as it is (plan_from_hf's overlap): nothing was written; plan again
                        for i in idx:
                            t = targets[i]
                            t.plan = plan_from_hf(t.source.path, t.options.policy, t.options,
                                                  repo_id=t.source.repo_id)
                        trips = cls._write_group([targets[i] for i in idx], [tmps[i] for i in idx], progress)
                    for i, trip in zip(idx, trips):
                        targets[i].roundtrip = trip
            finally:
                bar.close()
        shared = run.stages["quantize+write"] - before
        for r in {id(r): r for r in runs[1:] if r is not run}.values():
            r.stages["quantize+write"] = r.stages.get("quantize+write", 0.0) + shared
        for t, r in zip(targets, runs):
            key = t.verify_stage
            r.stages[key] = r.stages.get(key, 0.0) + t.roundtrip.seconds

    @staticmethod
    def _write_group(targets: list["GGUFTarget"], tmps: list[Path], progress) -> list[RoundTrip]:
        first = targets[0].plan
        files = [(tmp, t.plan.kvs, t.plan.types, t.plan.imatrix) for t, tmp in zip(targets, tmps)]
        return write_gguf_many(files, first.arch, first.tensors, targets[0].device,
                               progress=progress, verify=True)

    roundtrip: RoundTrip | None = None

    def verify(self, tmp: Path, run: Run) -> str:
        """The round trip that ran beside :meth:`write_together` (every write goes through
        it): RoundTripError on any mismatch."""
        rt = self.roundtrip
        if rt is None:
            raise RuntimeError(f"{tmp}: verify before write_together (no round trip ran)")
        if not rt.ok:
            raise RoundTripError("round-trip check failed, no output written: "
                                 + "; ".join(rt.mismatches[:5]))
        return (f"ok: {len(rt.tensors)} tensors re-read with gguf-py, dequantized "
                f"bit-identically by gguf-py and quantpress")

    def summary(self, out: Path, roundtrip: str, run: Run) -> Summary:
        rt, types = self.roundtrip, self.plan.types
        counts = dict(sorted(Counter(types.values()).items()))
        n_el = sum(t.numel for t in self.plan.tensors)
        lines = [f"tensors    {len(types)}: " + ", ".join(f"{k} x{v}" for k, v in counts.items())]
        finite = [t for t in rt.tensors if math.isfinite(t.snr_db)]
        worst = min(finite, key=lambda t: t.snr_db) if finite else None
        overall = None
        if rt.tensors:
            se = sum(t.rmse ** 2 * math.prod(t.shape) for t in rt.tensors)
            overall = math.sqrt(se / max(1, n_el))
            lines.append(f"error      overall RMSE {overall:.3e}, max |err| "
                         f"{max(t.max_abs_err for t in rt.tensors):.3e}"
                         + (f", lowest SNR {worst.snr_db:.1f} dB ({worst.name}, {worst.type})"
                            if worst else ", lossless"))
        pl = self.plan
        changed = {n: (pl.base_types[n], t) for n, t in types.items() if pl.base_types.get(n, t) != t}
        if changed:
            shown = ", ".join(f"{n} {a}->{b}" for n, (a, b) in list(changed.items())[:8])
            more = f" (+{len(changed) - 8} more)" if len(changed) > 8 else ""
            lines.append(f"overrides  {len(changed)} tensors changed: {shown}{more}")
        if pl.importance is not None:
            lines.append(f"imatrix    {pl.importance.file}: {len(pl.imatrix)} tensors weighted"
                         + (f", {len(pl.no_entry)} without an entry ({', '.join(pl.no_entry[:4])}"
                            + (", ..." if len(pl.no_entry) > 4 else "") + ")" if pl.no_entry else ""))
        details = {
            "policy": self.options.policy, "type_counts": counts, "rmse": overall,
            "roundtrip_checker_processes": rt.checker_processes,
            "overrides": {n: {"policy": a, "written": b} for n, (a, b) in changed.items()},
            "imatrix": None if pl.importance is None else {
                "file": pl.importance.file, "weighted": sorted(pl.imatrix), "no_entry": pl.no_entry},
            "tensors": [{"name": t.name, "type": t.type, "shape": list(t.shape), "bytes": t.n_bytes,
                         "bpw": t.bpw, "rmse": t.rmse, "max_abs_err": t.max_abs_err,
                         "snr_db": t.snr_db if math.isfinite(t.snr_db) else None}
                        for t in rt.tensors]}
        return Summary(self.kind, self.options.policy, out, str(self.source.path),
                       tensor_bytes=sum(t.n_bytes for t in rt.tensors), parameters=n_el,
                       roundtrip=roundtrip, details=details, lines=lines)
