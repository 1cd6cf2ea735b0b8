"""The K-quant search's steps compiled by TorchInductor (quantize.ggml.compiled_searches) give
llama.cpp's bytes: every type that runs make_qkx2_quants (Q2_K, Q4_K, Q5_K; Q4_1 and Q5_1
with importance weights), with and without an importance vector, on the codec tests' inputs
(tests/ggml_ref.py's ggml_quantize_chunk as the reference); each test also checks that the
compiled steps ran (and, for the range check, that they handed over to the eager steps).
The GGUF target turns them on for large jobs, compiles before forking its codec processes,
and writes the file it writes without them."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ggml_ref
import quantpress.quantize.ggml as qg
from quantpress.cli.convert_main import main as convert_main
from quantpress.quantize.ggml import compiled_searches as cs
from quantpress.quantize.ggml import kquants
from quantpress.targets.gguf import GGUFOptions, plan_from_hf
from test_ggml_codecs import INPUTS
from test_ggml_imatrix import _imatrix, _random_tensor, _special_rows

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


@pytest.fixture
def steps(monkeypatch):
    """The compiled steps turned on; yields the list of (steps done, steps asked) per call."""
    monkeypatch.setenv("QUANTPRESS_COMPILED_SEARCHES", "1")
    done = []
    run = cs.run_steps

    def spy(*args, **kw):
        n = run(*args, **kw)
        done.append((n, len(args[8])))         # (steps done, numerators given)
        return n

    monkeypatch.setattr(cs, "run_steps", spy)
    return done


def _check(x: np.ndarray, name: str, im: np.ndarray | None = None) -> None:
    ref = ggml_ref.ref_quantize(x, name, imatrix=im)
    ours = qg.quantize(torch.from_numpy(x), name, None if im is None else torch.from_numpy(im)).numpy()
    size = qg.get(name).type_size
    bad = np.nonzero((ours.reshape(-1, size) != ref.reshape(-1, size)).any(1))[0]
    assert bad.size == 0, f"{name}: {bad.size} of {ref.size // size} blocks differ, first {bad[:8]}"


def _tame_edge_rows() -> np.ndarray:
    """The codec tests' edge rows (zeros, signed zeros, constants, ties, outliers, huge values
    whose squares overflow, mixed magnitudes) without the subnormal ones, whose inverse scales
    overflow: their scaled values leave the fast rounding's range."""
    x = INPUTS["edge_rows"]()
    return x[np.abs(x).max(1) > 1e-37]


@pytest.mark.parametrize("name", ["Q2_K", "Q4_K", "Q5_K"])
@pytest.mark.parametrize("kind", ["fp16_rows", "llm_like_rows", "random_rows", "tame_edge_rows"])
def test_compiled_steps_match_llamacpp(steps, name, kind):
    _check(_tame_edge_rows() if kind == "tame_edge_rows" else INPUTS[kind](), name)
    assert steps and all(n == asked for n, asked in steps), steps


@pytest.mark.parametrize("name", ["Q2_K", "Q4_K", "Q5_K"])
@pytest.mark.parametrize("kind", ["edge_rows", "fuzz_rows"])
def test_out_of_range_values_take_the_eager_steps(steps, name, kind):
    # subnormal rows (an infinite inverse scale) fail the range check from the first step:
    # the slices holding them are searched by the eager steps
    _check(INPUTS[kind](), name)
    assert steps and any(n < asked for n, asked in steps), steps


@pytest.mark.parametrize("name", ["Q2_K", "Q4_K", "Q5_K", "Q4_1", "Q5_1"])
@pytest.mark.parametrize("im_kind", ["lognormal", "zeros", "huge", "tiny", "all_zero"])
def test_compiled_weighted_steps_match_llamacpp(steps, name, im_kind):
    x = np.concatenate([_tame_edge_rows(), _random_tensor(3, 24, 256)])
    _check(x, name, _imatrix(im_kind, 256))
    _check(_special_rows(), name, _imatrix(im_kind, 1024, seed=1))
    assert steps and all(n == asked for n, asked in steps), steps


@pytest.mark.parametrize("name,bound", [("Q2_K", 3.2), ("Q4_K", 15.0), ("Q4_1", 15.0)])
def test_steps_outside_the_rounding_range_go_on_eagerly(steps, name, bound, monkeypatch):
    # with the fast rounding's range lowered below the later steps' numerators (rmin +
    # rdelta*k + nmax, the largest scaled value), those steps fail the range check: the eager
    # steps (with C's integer rounding there) go on from the state the compiled ones reached
    monkeypatch.setattr(kquants, "NI_SAFE", bound)
    x = np.concatenate([_random_tensor(4, 32, 256), _tame_edge_rows()])
    _check(x, name, _imatrix("lognormal", 256) if name == "Q4_1" else None)
    assert any(0 < n < asked for n, asked in steps), steps


def test_off_by_default_and_by_environment(monkeypatch):
    calls = []
    monkeypatch.setattr(cs, "run_steps", lambda *a, **k: calls.append(1) or 0)
    x = torch.from_numpy(_random_tensor(6, 8, 256))
    monkeypatch.delenv("QUANTPRESS_COMPILED_SEARCHES", raising=False)
    assert not cs.enabled()
    qg.quantize(x, "Q4_K")
    assert calls == []
    monkeypatch.setenv("QUANTPRESS_COMPILED_SEARCHES", "0")
    cs.enable()
    try:
        assert not cs.enabled()
        qg.quantize(x, "Q4_K")
        assert calls == []
    finally:
        cs.enable(False)


def test_without_a_compiler_the_eager_search_is_used(tmp_path):
    # a fresh kernel cache and no working C++ compiler: one warning, the eager steps, the
    # same bytes as with the compiled steps off
    code = ("import torch\n"
            "from quantpress.quantize import ggml\n"
            "from quantpress.quantize.ggml import compiled_searches as cs\n"
            "x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))\n"
            "a = ggml.quantize(x, 'Q4_K')\n"
            "print(cs.enabled())\n"
            "cs.enable(False)\n"
            "import os; os.environ['QUANTPRESS_COMPILED_SEARCHES'] = '0'\n"
            "print(torch.equal(a, ggml.quantize(x, 'Q4_K')))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, CXX="/bin/false", TORCHINDUCTOR_CACHE_DIR=str(tmp_path),
                                QUANTPRESS_COMPILED_SEARCHES="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["False", "True"]
    assert r.stderr.count("RuntimeWarning: quantpress: compiling the K-quant search failed") == 1, r.stderr[-2000:]


_AT_CAPABILITY = """
import sys, numpy as np, torch
from quantpress.quantize import ggml
from quantpress.quantize.ggml import compiled_searches as cs
done = []
run = cs.run_steps
cs.run_steps = lambda *a, **k: done.append(run(*a, **k)) or done[-1]
x = torch.from_numpy(np.random.default_rng(0).standard_normal((64, 256), dtype=np.float32))
sys.stdout.buffer.write(ggml.quantize(x, "Q4_K").numpy().tobytes())
import os
print(cs.enabled() and sum(done) > 0, torch.backends.cpu.get_cpu_capability(),
      os.environ["TORCHINDUCTOR_CACHE_DIR"], file=sys.stderr)
"""


def test_kernels_are_kept_per_instruction_set(monkeypatch):
    """A process at another CPU capability than this one's (``avx2`` on an AVX-512 machine,
    else torch's scalar ``default``) compiles and uses kernels of its own, not those this
    process compiled for its vector instructions, which Inductor's cache would hand it (at
    ``avx2`` after AVX-512 they gave wrong values and Q4_K bytes that are not llama.cpp's; at
    ``default`` they failed to compile), and writes llama.cpp's bytes. One such process (15-20
    s of a loaded CI worker with its kernels cached)."""
    monkeypatch.setenv("QUANTPRESS_COMPILED_SEARCHES", "1")
    assert cs.warm_up(mad=False)                    # this process's kernels are in the cache
    here = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert here == str(cs.kernel_cache_dir()) and Path(here).name == cs.machine_key()
    native = torch.backends.cpu.get_cpu_capability()
    cap = "avx2" if native == "AVX512" else "default"
    x = np.random.default_rng(0).standard_normal((64, 256), dtype=np.float32)
    ref = ggml_ref.ref_quantize(x, "Q4_K").tobytes()   # (numpy's values: torch's randn differs by capability)
    r = subprocess.run([sys.executable, "-c", _AT_CAPABILITY], capture_output=True, timeout=900,
                       env=dict(os.environ, ATEN_CPU_CAPABILITY=cap))
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 0, err[-2000:]
    assert "RuntimeWarning" not in err, err[-2000:]
    used, got_cap, there = err.split()[-3:]
    assert (used, got_cap) == ("True", cap.upper()), err[-2000:]
    assert there != here and Path(there).parent == Path(here).parent and Path(there).is_dir()
    assert r.stdout == ref


def test_worth_it_counts_the_search_weights(smollm2_dir):
    # SmolLM2's Q4_K_M (576-wide tensors fall back to legacy types) stays below the threshold
    plan = plan_from_hf(smollm2_dir, "Q4_K_M", GGUFOptions(policy="Q4_K_M"), overlap=False)
    assert not cs.worth_it((plan.types[t.name], t.numel, False) for t in plan.tensors)
    n = cs.MIN_WEIGHTS
    assert cs.worth_it([("Q4_K", n // 2, False), ("Q5_K", n // 2, False)])
    assert not cs.worth_it([("Q4_K", n // 2, False), ("Q6_K", n, False), ("Q4_1", n, False)])
    assert cs.worth_it([("Q2_K", n // 2, False), ("Q4_1", n // 2, True)])


def test_gguf_target_compiles_for_large_jobs_and_writes_the_same_file(synth_llama_dir, tmp_path, monkeypatch):
    """With the threshold lowered to the synthetic llama, convert hf-to-gguf turns the
    compiled steps on, compiles them before its codec processes are forked, and writes the
    bytes it writes without them (themselves llama-quantize's: test_hf_to_gguf.py)."""
    def convert(out: Path) -> None:
        assert convert_main(["hf-to-gguf", str(synth_llama_dir), "--policy", "Q4_K_M", "-o", str(out),
                             "--quiet", "--device", "cpu"]) == 0

    monkeypatch.delenv("QUANTPRESS_COMPILED_SEARCHES", raising=False)
    convert(tmp_path / "eager.gguf")
    assert not cs.enabled()
    warmed = []
    warm_up = cs.warm_up
    monkeypatch.setattr(cs, "warm_up", lambda mad: warmed.append(warm_up(mad)) or warmed[-1])
    monkeypatch.setattr(cs, "MIN_WEIGHTS", 1 << 20)
    try:
        convert(tmp_path / "compiled.gguf")
        assert cs.enabled() and warmed == [True]
    finally:
        cs.enable(False)
    assert (tmp_path / "compiled.gguf").read_bytes() == (tmp_path / "eager.gguf").read_bytes()
