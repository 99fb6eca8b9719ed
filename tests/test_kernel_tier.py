"""The kernel tier's conventions (docs/design.rst, "Kernel tier"), read from the source: no
Numba compile, no GPU."""

import ast
from pathlib import Path

import pytest

import spchain.kernels

KERNELS = Path(spchain.kernels.__file__).parent

GPU_ONLY = {"chain_transition_grad_masked", "sparse_chain_values_grad_masked", "log_product_fixup",
            "log_product_posinf_fixup", "log_product_grads"}
"""CUDA launchers without a CPU kernel: the CPU path needs no masked variant, and the log-space
product's NumPy twin is ``spchain/_logspace.py``."""


def functions(target):
    """``{module: [FunctionDef, ...]}`` of ``spchain/kernels/<target>/``, nested ones included."""
    return {path.stem: [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)]
            for path in sorted((KERNELS / target).glob("*.py"))}


def is_kernel(node):
    """Whether ``node`` is decorated ``@cuda.jit`` (a kernel, not a device function)."""
    for decorator in node.decorator_list:
        call = decorator if isinstance(decorator, ast.Call) else None
        target = call.func if call else decorator
        if isinstance(target, ast.Attribute) and target.attr == "jit" and getattr(target.value, "id", "") == "cuda":
            device = any(k.arg == "device" and getattr(k.value, "value", False) for k in (call.keywords if call else []))
            return not device
    return False


CUDA_KERNELS = [(module, node) for module, nodes in functions("cuda").items() for node in nodes if is_kernel(node)]
LAUNCHERS = [(module, node.name.removeprefix("launch_")) for module, nodes in functions("cuda").items()
             for node in nodes if node.name.startswith("launch_")]


def test_the_source_scan_finds_the_kernels():
    assert len(CUDA_KERNELS) >= 20 and len(LAUNCHERS) >= 20


@pytest.mark.parametrize("module, node", CUDA_KERNELS, ids=[node.name for _, node in CUDA_KERNELS])
def test_every_cuda_kernel_is_named_and_documented(module, node):
    assert node.name.endswith("_kernel"), f"{module}.{node.name}: a @cuda.jit kernel is named <op>_kernel"
    doc = ast.get_docstring(node) or ""
    assert "Input" in doc and "Output" in doc and "Launch:" in doc, (
        f"{module}.{node.name}: its docstring gives its inputs, outputs and launch geometry")


@pytest.mark.parametrize("module, name", LAUNCHERS, ids=[name for _, name in LAUNCHERS])
def test_every_launcher_launches_the_kernel_of_its_name(module, name):
    kernels = {node.name for m, node in CUDA_KERNELS if m == module}
    assert f"{name}_kernel" in kernels, f"launch_{name} of kernels/cuda/{module}.py launches {name}_kernel"


@pytest.mark.parametrize("module, name", LAUNCHERS, ids=[name for _, name in LAUNCHERS])
def test_every_launcher_has_a_cpu_twin_of_the_same_name(module, name):
    cpu = {node.name for nodes in functions("cpu").values() for node in nodes}
    assert name in cpu or name in GPU_ONLY, f"launch_{name} has no CPU kernel named {name}"
