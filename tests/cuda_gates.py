#!/usr/bin/env python3
"""The CUDA kernels' gates without a GPU, from the build's own artifacts.

ptxas:  every kernel of every target: no spill, no stack frame; the hot kernels
        (forward_kernel, backward_kernel) within their Plan's budget: registers within
        65536 / threads (and the 255 a thread can address), dynamic shared memory within
        what a block may opt into on that target.
sass:   the hot kernels' SASS of every target uses the tensor cores (HMMA.16816), ldmatrix
        (LDSM) and cp.async (LDGSTS), and never local memory (LDL / STL).

usage: cuda_gates.py PLAN_TABLE_EXE CUOBJDUMP_OR_EMPTY OBJECT.o... (each OBJECT.o has its
       report beside it as OBJECT.ptxas.log)
Prints one line per check and 'N passed, N failed'; exits non-zero on any failure.
"""
import re
import subprocess
import sys
from pathlib import Path

# Shared memory a block may opt into (CUDA C++ Programming Guide, compute capabilities).
MAX_SHARED = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}
MAX_REGISTERS_PER_THREAD = 255
REGISTERS_PER_SM = 65536
HOT = ("forward_kernel", "backward_kernel")

passed = failed = 0


def check(ok, what):
    global passed, failed
    print(("ok    " if ok else "FAIL  ") + what)
    if ok:
        passed += 1
    else:
        failed += 1


def hot_name(mangled):
    for name in HOT:
        m = re.search(name + r"ILi(\d+)E", mangled)
        if m:
            return name, int(m.group(1))
    return None


def short(mangled):
    m = re.search(r"((?:forward|backward|prepare|convert)_kernel)I(Li\d+E)?N\S*?(Bf16|F16)", mangled)
    return f"{m.group(1)}<{m.group(2)[2:-1] + ', ' if m.group(2) else ''}{m.group(3)}>" if m else mangled


def ptxas_gate(log, budgets):
    text = log.read_text()
    entries = re.findall(
        r"Compiling entry function '(\S+)' for '(sm_\d+)'\s*\n"
        r"ptxas info\s*: Function properties for \S+\s*\n"
        r"\s*(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads\s*\n"
        r"ptxas info\s*: Used (\d+) registers", text)
    check(len(entries) > 0, f"{log.name}: ptxas reported {len(entries)} kernels")
    for mangled, arch, stack, spill_st, spill_ld, regs in entries:
        label = f"{arch} {short(mangled)}"
        check(int(spill_st) == 0 and int(spill_ld) == 0, f"{label}: no spills ({spill_st} B stored, {spill_ld} B loaded)")
        check(int(stack) == 0, f"{label}: no stack frame ({stack} B)")
        hot = hot_name(mangled)
        if hot:
            threads, smem = budgets[hot]
            limit = min(MAX_REGISTERS_PER_THREAD, REGISTERS_PER_SM // threads)
            check(int(regs) <= limit, f"{label}: {regs} registers <= {limit} for {threads} threads")
            check(smem <= MAX_SHARED[arch], f"{label}: plan's {smem} B shared memory <= {MAX_SHARED[arch]}")
    return {(hot_name(m), a) for m, a, *_ in entries if hot_name(m)}


def sass_gate(cuobjdump, obj):
    out = subprocess.run([cuobjdump, "-sass", str(obj)], check=True, capture_output=True, text=True).stdout
    functions = {}
    arch = None
    current = None
    for line in out.splitlines():
        m = re.match(r"\s*arch = (sm_\d+)", line)
        if m:
            arch = m.group(1)
            continue
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            current = (arch, m.group(1))
            functions[current] = []
            continue
        if current:
            functions[current].append(line)
    hot = {k: v for k, v in functions.items() if hot_name(k[1])}
    check(len(hot) > 0, f"{obj.name}: {len(hot)} hot kernels disassembled")
    for (arch, mangled), lines in sorted(hot.items()):
        body = "\n".join(lines)
        label = f"{arch} {short(mangled)}"
        for op in ("HMMA.16816", "LDSM", "LDGSTS"):
            check(op in body, f"{label}: uses {op}")
        local = re.findall(r"\b(LDL|STL)\b", body)
        check(not local, f"{label}: no local memory ({len(local)} LDL/STL)")


def main():
    table, cuobjdump, objects = sys.argv[1], sys.argv[2], [Path(p) for p in sys.argv[3:]]
    budgets = {}
    for line in subprocess.run([table], check=True, capture_output=True, text=True).stdout.splitlines():
        name, bucket, threads, smem = line.split()
        budgets[(name, int(bucket))] = (int(threads), int(smem))
    seen = set()
    for obj in objects:
        seen |= ptxas_gate(obj.with_suffix(".ptxas.log"), budgets)
    for key in budgets:
        for arch in MAX_SHARED:
            check((key, arch) in seen, f"{arch} {key[0]}<{key[1]}>: compiled")
    if cuobjdump:
        for obj in objects:
            sass_gate(cuobjdump, obj)
    else:
        check(False, "no cuobjdump: scripts/setup installs it (PyPI nvidia-cuda-cuobjdump)")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
