"""Shared machinery for testing Triton kernels on a CPU-only machine.

- The interpreter: ``TRITON_INTERPRET`` must be set before ``import triton`` (Triton's own
  ``tl.cdiv``/``tl.max``/``tl.sum`` are ``@jit`` functions decorated at that import, and an
  interpreted kernel cannot call compiled ones), and setting it for the whole session would turn
  every other test's kernels into interpreted ones. So a test file's ``interpreted`` tests are
  rerun in a child pytest with the variable set (:func:`run_interpreted_tests`); in that child
  (or in any run started with ``TRITON_INTERPRET=1``) they run directly and the compiled tiers
  skip.
- The sm_90 compile check: a kernel's real launch arguments are recorded
  (:class:`RecordLaunches`) and compiled to a Hopper cubin (:func:`compile_sm90`), which catches
  what the interpreter accepts but the compiler rejects (e.g. ``tl.dot`` with K<16).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from xml.etree import ElementTree

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted_only = pytest.mark.skipif(not INTERPRETED, reason="runs in test_interpreter_suite")
compiled_only = pytest.mark.skipif(INTERPRETED, reason="kernels are interpreted in this process")
needs_cuda = pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs CUDA")
REPO = Path(__file__).parents[1]


def run_interpreted_tests(test_file: str) -> None:
    """Run ``test_file``'s tests whose names contain ``interpreted`` in a child pytest with
    ``TRITON_INTERPRET=1``; fail with the child's output if any fails or skips, or none ran
    (a suite whose every test skipped would otherwise pass having checked nothing)."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-k", "interpreted",
             f"--junitxml={report}", test_file], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        output = proc.stdout[-6000:] + proc.stderr[-2000:]
        assert proc.returncode == 0, output
        suite = ElementTree.parse(report).getroot().find("testsuite")
        ran, skipped = int(suite.get("tests")), int(suite.get("skipped"))
    assert ran > 0 and skipped == 0, f"{ran} interpreted tests, {skipped} of them skipped:\n{output}"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``|out - ref| / |ref|`` in ``ref``'s dtype; a non-finite ``out`` fails outright."""
    out = out.to(ref.dtype)
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out - ref).norm() / ref.norm())


class RecordLaunches:
    """Stands in for a kernel: ``kernel[grid](...)`` records the call instead of launching."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.calls: list[dict] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs) -> None:
            self.calls.append(dict(zip(self.fn.arg_names, args), **kwargs))
        return launch


_PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32",
        torch.float8_e4m3fn: "*fp8e4nv", torch.uint8: "*u8", torch.int32: "*i32", torch.int64: "*i64"}


def compile_sm90(fn, call: dict):
    """Compile one recorded launch for sm_90, specialised as the JIT would on a GPU: ints equal
    to 1 become constants, pointers and ints divisible by 16 are marked so (this is what lets
    the compiler vectorise loads, so resource use matches a real launch)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
    call = dict(call)
    options = {k: call.pop(k) for k in ("num_warps", "num_stages", "launch_pdl", "maxnreg", "enable_fp_fusion") if k in call}
    if "PDL" in call:  # recorded on CPU tensors, where it is off; on sm_90 it is on
        call["PDL"] = options["launch_pdl"] = True
    signature, constexprs, attrs = {}, {}, {}
    aligned = [["tt.divisibility", 16]]
    for i, param in enumerate(fn.params):
        value = call[param.name]
        if type(value).__name__ == "TensorDescriptor":  # a host-side TMA descriptor
            from triton.runtime.jit import mangle_type
            signature[param.name] = mangle_type(value)
            continue
        is_one = type(value) is int and value == 1 and not param.do_not_specialize
        if param.is_constexpr or is_one:
            signature[param.name], constexprs[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = _PTR[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(i,)] = aligned
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if abs(value) < 2 ** 31 else "i64"
            if value % 16 == 0 and not param.do_not_specialize:
                attrs[(i,)] = aligned
        else:
            signature[param.name] = "fp32"
    source = GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource
    return triton.compile(source(fn, signature, constexprs, attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def record_launches(monkeypatch: pytest.MonkeyPatch, module, names: tuple[str, ...]) -> dict[str, "RecordLaunches"]:
    """Swap ``module``'s kernels for recorders of their launches (the sm_90 compile check's input)."""
    recs = {name: RecordLaunches(getattr(module, name)) for name in names}
    for name, rec in recs.items():
        monkeypatch.setattr(module, name, rec)
    return recs


def compile_recorded(recs: dict[str, "RecordLaunches"]) -> None:
    """Compile every recorded launch for sm_90 (real argument specialisation, no GPU needed)."""
    for rec in recs.values():
        for call in rec.calls:
            compile_sm90(rec.fn, call)
