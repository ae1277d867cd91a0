#!/usr/bin/env python3
"""sass_budget: the static instruction budget of the CUDA kernels' main loops, without a GPU.

Compiles kernels/cuda/*.cu for sm_90a with the flags of third_party/cuda.bzl, disassembles the
cubins with cuobjdump (from the pinned PyPI wheel nvidia-cuda-cuobjdump, fetched into
.cache/sass-tools on first use) and, for every kernel whose name matches --filter, finds its main
loop (the backward branch whose body holds the most MMA instructions) and counts what the loop
issues per MMA, split into classes:

  decode   E2M1/scale conversion: LOP3, SHF, PRMT, HMUL2/HFMA2, IMAD.SHL/IMAD.U32 moves
  mma      HMMA (mma.sync) and HGMMA (wgmma)
  memory   global/shared loads and stores, cp.async, bulk copies, mbarrier operations
  control  branches, predicates, barriers, uniform-datapath bookkeeping
  other    everything else (address arithmetic, conversions, epilogue math hoisted into the loop)

The counts are static: a loop body holding both sides of a branch (a full and a partial group of
a copy ring, say) counts both, so control and memory overstate what one iteration executes; the
decode and MMA classes are straight-line code and exact.

With the register count from ptxas (-Xptxas -v), this is the evidence for "how many instructions
does one chunk of weights cost" that the GPU measurements (ncu issue-slot utilization, DRAM %)
are compared against. Example:

  python3 bench/sass_budget.py --filter 'ExpertGemmKernelCapped.*Mxfp4ELb1ELi1ELi12E'

Prints one row per kernel; --json writes them. Needs nvcc (/usr/local/cuda/bin/nvcc) and either
the package index or both wheels in .cache/sass-tools.
"""

import argparse
import collections
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC = "/usr/local/cuda/bin/nvcc"
# third_party/cuda.bzl NVCC_FLAGS, SASS only (the PTX copy does not change the SASS).
NVCC_FLAGS = ["-std=c++20", "-O3", "-gencode=arch=compute_90a,code=sm_90a",
              "--expt-relaxed-constexpr", "-DMOE_HAVE_CUDA=1", "-I."]
# The earliest CUDA 13 versions on the index are 13.2; these disassemble nvcc 13.0's sm_90a cubins.
WHEELS = {"cuobjdump": "nvidia-cuda-cuobjdump==13.5.37", "nvdisasm": "nvidia-cuda-nvdisasm==13.5.37"}
TOOLS = os.path.join(ROOT, ".cache", "sass-tools")
DEFAULT_SOURCES = ["kernels/cuda/expert_gemm.cu", "kernels/cuda/expert_gemm_tiled.cu",
                   "kernels/cuda/expert_gemm_wgmma.cu"]

CLASSES = {
    "decode": {"LOP3", "SHF", "PRMT", "HMUL2", "HFMA2", "HADD2", "F2FP"},
    "mma": {"HMMA", "HGMMA", "WARPGROUP"},
    "memory": {"LDG", "LDS", "LDSM", "STS", "STG", "LDGSTS", "LDGDEPBAR", "DEPBAR", "UBLKCP",
               "SYNCS", "LD", "ST", "ATOMS", "RED", "UTMALDG", "CCTL"},
    "control": {"BRA", "ISETP", "PLOP3", "BAR", "WARPSYNC", "BSSY", "BSYNC", "NOP", "UISETP",
                "UIADD3", "UMOV", "ULDC", "USHF", "ULEA", "UIMAD", "ULOP3", "USEL", "R2UR",
                "VOTEU", "VOTE", "EXIT", "YIELD", "UPRMT", "S2UR"},
}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def cuobjdump():
    """Path of cuobjdump, with nvdisasm (which it runs) beside it; fetched once."""
    bin_dir = os.path.join(TOOLS, "nvidia", "cu13", "bin")
    for tool, pin in WHEELS.items():
        exe = os.path.join(bin_dir, tool)
        if os.path.exists(exe):
            continue
        os.makedirs(TOOLS, exist_ok=True)
        pattern = os.path.join(TOOLS, f"nvidia_cuda_{tool}-*.whl")
        if not glob.glob(pattern):
            log(f"fetching {pin} into {TOOLS}")
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d",
                            TOOLS, pin], check=True)
        with zipfile.ZipFile(glob.glob(pattern)[0]) as z:
            z.extractall(TOOLS)
        os.chmod(exe, 0o755)
    os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    return os.path.join(bin_dir, "cuobjdump")


def compile_cubin(src, out_dir):
    cubin = os.path.join(out_dir, os.path.basename(src).replace(".cu", ".cubin"))
    log(f"nvcc sm_90a {src}")
    r = subprocess.run([NVCC, *NVCC_FLAGS, "-cubin", "-Xptxas", "-v", "-o", cubin, src],
                       cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"nvcc failed on {src}:\n{r.stderr[-4000:]}")
    regs, current = {}, None
    for line in r.stderr.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current = m.group(1)
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            regs[current] = int(m.group(1))
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and current and int(m.group(1)) > 0:
            regs[current + "#spill"] = int(m.group(1))
    return cubin, regs


def parse_functions(sass):
    for chunk in sass.split("Function : ")[1:]:
        name = chunk.split("\n", 1)[0].strip()
        code = []
        for line in chunk.split("\n"):
            m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
            if m:
                code.append((int(m.group(1), 16), m.group(2).strip()))
        yield name, code


def opcode(text):
    text = re.sub(r"^@!?U?P[T0-9]+\s+", "", text)
    return text.split()[0].split(".")[0]


def klass(op, text):
    if op == "IMAD" and (".SHL" in text or ".U32" in text or ".MOV" in text):
        return "decode" if ".SHL" in text else "other"
    for name, ops in CLASSES.items():
        if op in ops:
            return name
    return "other"


def main_loop(code):
    """The backward branch whose body [target, branch] holds the most MMA instructions."""
    best = None
    for addr, text in code:
        m = re.search(r"\bBRA\s+0x([0-9a-f]+)", text)
        if not m or ".ANY" in text:  # BRA.U.ANY: the per-lane loop of an elect/bulk-copy idiom
            continue
        target = int(m.group(1), 16)
        if target >= addr:
            continue
        body = [(a, t) for a, t in code if target <= a <= addr]
        mma = sum(opcode(t) in ("HMMA", "HGMMA") for _, t in body)
        if mma and (best is None or mma > best[0] or (mma == best[0] and len(body) < len(best[1]))):
            best = (mma, body)
    return best


def analyze(name, code, regs):
    loop = main_loop(code)
    row = {"kernel": name, "registers": regs.get(name), "spill_bytes": regs.get(name + "#spill", 0),
           "instructions": len(code)}
    if loop is None:
        return row
    mma, body = loop
    ops = collections.Counter(opcode(t) for _, t in body)
    classes = collections.Counter(klass(opcode(t), t) for _, t in body)
    row.update({"loop_instructions": len(body), "loop_mma": mma,
                "per_mma": {k: round(v / mma, 2) for k, v in sorted(classes.items())},
                "instructions_per_mma": round(len(body) / mma, 2),
                "top_opcodes": dict(ops.most_common(12))})
    return row


def short(name):
    """moe::cuda::...::ExpertGemmKernelCapped<moe::cuda::detail::Mxfp4, true, 1, 12>(...) ->
    ExpertGemmKernelCapped<Mxfp4, true, 1, 12>."""
    r = subprocess.run(["c++filt", name], capture_output=True, text=True)
    text = r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else name
    text = re.sub(r"\(moe::cuda::ExpertGemmParams, int\)$", "", text)
    text = re.sub(r"^void ", "", text)
    return re.sub(r"[\w:]*::|\(anonymous namespace\)::", "", text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sources", nargs="*", default=DEFAULT_SOURCES,
                    help="CUDA sources to compile (default: the three expert GEMM files)")
    ap.add_argument("--filter", default="", help="regex on the mangled kernel names")
    ap.add_argument("--json", default="", help="write the rows here")
    ap.add_argument("--keep", default="", help="keep cubins and SASS in this folder")
    args = ap.parse_args()
    tool = cuobjdump()
    out_dir = args.keep or tempfile.mkdtemp(prefix="sass_budget_")
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for src in args.sources:
        cubin, regs = compile_cubin(src, out_dir)
        sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
        if args.keep:
            with open(cubin.replace(".cubin", ".sass"), "w") as f:
                f.write(sass)
        for name, code in parse_functions(sass):
            if args.filter and not re.search(args.filter, name):
                continue
            rows.append(dict(analyze(name, code, regs), source=src))
    print(f"{'kernel':<70} {'regs':>4} {'loop':>5} {'mma':>4} {'i/mma':>6}  per MMA")
    for r in rows:
        if "loop_mma" not in r:
            continue
        per = " ".join(f"{k} {v}" for k, v in r["per_mma"].items())
        print(f"{short(r['kernel']):<70} {r['registers'] or '-':>4} {r['loop_instructions']:>5} "
              f"{r['loop_mma']:>4} {r['instructions_per_mma']:>6}  {per}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tool": "sass_budget", "wheels": list(WHEELS.values()), "rows": rows}, f,
                      indent=1)
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
