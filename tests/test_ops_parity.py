"""The models are written once against ops (ARCHITECTURE.md): every operation the numpy backend offers a model, the
CUDA backend offers under the same name, with as many parameters and the same names for those with defaults (the
ones models pass by keyword: shared=, readers=, addend=). No GPU needed: the classes are compared, not run."""

import inspect

from infero.backends.cpu.ops import CpuOps
from infero.backends.cuda.ops import CudaOps


def public(cls) -> dict:
    return {name: member for name, member in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}


def shape(fn) -> tuple[int, list[str]]:
    params = inspect.signature(fn).parameters.values()
    return len(params), [p.name for p in params if p.default is not inspect.Parameter.empty]


def test_every_numpy_op_is_a_cuda_op_with_its_parameters():
    cpu, cuda = public(CpuOps), public(CudaOps)
    assert sorted(set(cpu) - set(cuda)) == []
    assert {name: shape(fn) for name, fn in cpu.items()} == {name: shape(cuda[name]) for name in cpu}
