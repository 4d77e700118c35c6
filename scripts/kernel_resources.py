"""Registers, spills, stack and shared memory of every kernel of a .cu file, as ptxas reports them, and the SASS of
one instantiation's hottest loop (no GPU needed).

python scripts/kernel_resources.py matvec.cu [--arch sm_90a] [--grep PATTERN]
python scripts/kernel_resources.py matvec.cu --sass "matvec_q<12, 1, 2, -1>"

--sass needs cuobjdump and nvdisasm: pip install -e ".[dev]" (the nvidia-cuda-cuobjdump / -nvdisasm wheels). It
prints the instruction count and opcode histogram of the largest loop body (the span of the longest backward
branch): the number to shrink when a kernel is issue-bound.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from pathlib import Path

from cuda.bindings import nvrtc

from infero.backends.cuda import compiler, runtime
from infero.backends.cuda.ops import CudaOps  # noqa: F401  (importing the launchers declares their kernels)
from infero.backends.cuda.sampler import CudaRowSampler  # noqa: F401


def report(filename: str, arch: str, defines: dict | None = None) -> list[tuple[str, str]]:
    source = (compiler.KERNEL_DIR / filename).read_text()
    names = runtime.declared().get(filename, [])
    options = compiler.base_options(arch) + compiler.define_options(defines) + ["--ptxas-options=-v"]
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


def _cuda_binary(name: str) -> str:
    import nvidia

    for root in nvidia.__path__:
        for path in Path(root).glob(f"*/bin/{name}"):
            return str(path)
    raise SystemExit(f"{name} not found: pip install -e '.[dev]'")


def hottest_loop(
    filename: str, expression: str, arch: str, defines: dict | None = None
) -> tuple[int, collections.Counter]:
    """(instructions, opcode counts) of the largest loop body in the SASS of one instantiation."""
    source = (compiler.KERNEL_DIR / filename).read_text()
    compiled = compiler.compile_source(source, filename, arch, defines, [expression])
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.cubin)
        env = dict(os.environ, PATH=os.path.dirname(_cuda_binary("nvdisasm")) + os.pathsep + os.environ["PATH"])
        sass = subprocess.run([_cuda_binary("cuobjdump"), "-sass", "-fun", compiled.lowered[expression], str(cubin)],
                              capture_output=True, text=True, check=True, env=env).stdout  # fmt: skip
    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]+);", sass)]
    best = (0, 0)
    for address, text in code:
        if m := re.search(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", text):
            target = int(m.group(1), 16)
            if target < address and address - target > best[1] - best[0]:
                best = (target, address)
    body = [text for address, text in code if best[0] <= address <= best[1]]
    ops = collections.Counter(t.split()[1] if t.startswith("@") else t.split()[0] for t in body)
    return len(body), ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--grep", default="")
    parser.add_argument("--sass", metavar="EXPRESSION", help="the hottest loop of this instantiation's SASS")
    parser.add_argument("-D", dest="defines", action="append", default=[], help="NAME=VALUE for the build (repeat)")
    args = parser.parse_args()
    defines = dict(d.split("=", 1) if "=" in d else (d, 1) for d in args.defines)  # as ab_step.py --define builds
    if args.sass:
        count, ops = hottest_loop(args.file, args.sass, args.arch, defines)
        print(f"{args.sass}: {count} instructions in its largest loop body")
        for op, n in ops.most_common():
            print(f"{n:>5}  {op}")
        return
    merged: dict[str, list[str]] = {}
    for name, info in report(args.file, args.arch, defines):
        merged.setdefault(name, []).append(info)
    for name, infos in merged.items():
        if args.grep in name:
            print(f"{name:<36} " + " | ".join(infos))


if __name__ == "__main__":
    main()
