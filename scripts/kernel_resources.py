"""Registers, spills, stack and shared memory of every kernel of a .cu file, as ptxas reports them (no GPU needed).

python scripts/kernel_resources.py matvec.cu [--arch sm_90a] [--grep PATTERN]
"""

from __future__ import annotations

import argparse
import re

from cuda.bindings import nvrtc

from infero.backends.cuda import compiler, runtime
from infero.backends.cuda.ops import CudaOps  # noqa: F401  (importing the launchers declares their kernels)
from infero.backends.cuda.sampler import CudaRowSampler  # noqa: F401


def report(filename: str, arch: str) -> list[tuple[str, str]]:
    source = (compiler.KERNEL_DIR / filename).read_text()
    names = runtime.declared().get(filename, [])
    options = compiler.base_options(arch) + ["--ptxas-options=-v"]
    _, prog = nvrtc.nvrtcCreateProgram(source.encode(), filename.encode(), 0, [], [])
    try:
        for expr in names:
            nvrtc.nvrtcAddNameExpression(prog, expr.encode())
        nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
        size = nvrtc.nvrtcGetProgramLogSize(prog)[1]
        log = bytearray(size)
        nvrtc.nvrtcGetProgramLog(prog, log)
        demangled = {}
        for expr in names:
            lowered = nvrtc.nvrtcGetLoweredName(prog, expr.encode())[1]
            demangled[lowered.decode() if isinstance(lowered, bytes) else lowered] = expr
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    rows, current = [], None
    for line in log.decode(errors="replace").splitlines():
        if m := re.search(r"Compiling entry function '([^']+)'", line):
            current = demangled.get(m.group(1), m.group(1))
        elif current and ("registers" in line or "spill" in line or "stack frame" in line):
            rows.append((current, line.split("info    :")[-1].strip()))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--grep", default="")
    args = parser.parse_args()
    merged: dict[str, list[str]] = {}
    for name, info in report(args.file, args.arch):
        merged.setdefault(name, []).append(info)
    for name, infos in merged.items():
        if args.grep in name:
            print(f"{name:<36} " + " | ".join(infos))


if __name__ == "__main__":
    main()
