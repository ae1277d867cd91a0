#!/usr/bin/env python3
"""Problem D side by side with ggml's CPU MUL_MAT_ID, on this machine, in alternating rounds.

ggml is the peer that performance.md quotes for the CPU (its test-backend-ops times the same op:
MXFP4 2880x2880 experts, E=32, top-4, fp32 activations, at 1 and 512 tokens). Its figures there
come from another session's host; this script measures both on the host it runs on, round by
round (ggml, then ours), so that the ratio is not at the mercy of a shared machine's drift.

ggml is not part of this project: build its test-backend-ops from a checkout outside the
repository (cmake -DGGML_BUILD_TESTS=ON -DGGML_NATIVE=ON, Release) and pass the binary.

  ./moe bench cpu-peer --ggml_bin /path/to/build/bin/test-backend-ops [--rounds 3]

Writes bench/results/cpu_peer_ggml_<date>.json: every round's ggml and cpu_bench figures, the
medians over rounds and the ratios ggml time / ours. Both sides use all hardware threads
(test-backend-ops always does; cpu_bench --threads 0).
"""

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASE = "type_a=mxfp4,type_b=f32,n_mats=32,n_used=4,b=0,m=2880,n={n},k=2880"
# "MUL_MAT_ID(<case>):   1694 runs -   608.94 us/run -  66.36 MFLOP/run - 108.97 GFLOPS"
LINE = re.compile(r"MUL_MAT_ID\((?P<case>[^)]*)\):\s+(?P<runs>\d+) runs -"
                  r"\s+(?P<us>[0-9.]+) us/run")


def run(cmd, **kw):
    """stdout of cmd; on failure, exits with the command and what it printed."""
    r = subprocess.run(cmd, text=True, capture_output=True, **kw)
    if r.returncode != 0:
        sys.exit(f"cpu-peer: {' '.join(cmd)} exited with {r.returncode}:\n{r.stdout}{r.stderr}")
    return r.stdout


def ggml_round(binary, tokens):
    """us per run of ggml's MUL_MAT_ID perf case for each token count."""
    pattern = CASE.format(n="(" + "|".join(str(t) for t in tokens) + ")")
    out = run([binary, "perf", "-o", "MUL_MAT_ID", "-b", "CPU", "-p", pattern])
    found = {}
    for m in LINE.finditer(out):
        n = int(re.search(r"\bn=(\d+)", m.group("case")).group(1))
        found[n] = {"us_per_run": float(m.group("us")), "runs": int(m.group("runs"))}
    missing = [t for t in tokens if t not in found]
    if missing:
        sys.exit(f"cpu-peer: ggml printed no MUL_MAT_ID perf line for n={missing}; "
                 f"its output:\n{out}")
    return found


def ours_round(binary, runs, path):
    run([binary, "--sections=problem_d", "--large_reference=false", "--ref_runs=1",
         f"--runs={runs}", "--runs_large=7", f"--out_json={path}"], cwd=ROOT)
    with open(path) as f:
        d = json.load(f)
    os.unlink(path)
    pts = {}
    for p in d["problem_d"]:
        key = (p["tokens"], p.get("weights") or p.get("kernels"))
        pts[key] = p["optimized"]["median_ms"] * 1000.0
    return {"points_us": {f"{t}_{k}": v for (t, k), v in pts.items()},
            "read_bandwidth_gbs": d.get("read_bandwidth_gbs_at_start"),
            "load_average_at_end": d.get("load_average_at_end")}


def host():
    info = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            k, _, v = line.partition(":")
            k, v = k.strip(), v.strip()
            if k in ("model name", "cpu family", "model") and k not in info:
                info[k] = v
            if k == "flags" and "flags" not in info:
                info["flags"] = " ".join(x for x in v.split()
                                         if x.startswith(("avx512", "amx"))
                                         or x in ("avx2", "avx_vnni"))
    info["cpus"] = os.cpu_count()
    return info


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ggml_bin", required=True, help="ggml's test-backend-ops binary")
    ap.add_argument("--ggml_commit", default="", help="commit of the ggml checkout (recorded only)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--runs", type=int, default=101, help="cpu_bench runs per 1-token point")
    ap.add_argument("--out_json", default="", help="default bench/results/cpu_peer_ggml_<date>.json")
    a = ap.parse_args()
    if not os.access(a.ggml_bin, os.X_OK):
        sys.exit(f"cpu-peer: --ggml_bin {a.ggml_bin!r} is not an executable file")
    if a.rounds < 1:
        sys.exit("cpu-peer: --rounds must be at least 1")
    print("cpu-peer: building //bench:cpu_bench (-c opt)", file=sys.stderr)
    cuda = os.access("/usr/local/cuda/bin/nvcc", os.X_OK) and os.environ.get("MOE_NOCUDA") != "1"
    config = [] if cuda else ["--config=nocuda"]
    if subprocess.run(["bazel", "build", "-c", "opt", *config, "//bench:cpu_bench"],
                      cwd=ROOT).returncode != 0:
        sys.exit("cpu-peer: building //bench:cpu_bench failed")
    ours_bin = os.path.join(ROOT, "bazel-bin/bench/cpu_bench")
    commit = run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT).strip()
    tokens = [1, 512]
    rounds = []
    for r in range(a.rounds):
        print(f"cpu-peer: round {r + 1}/{a.rounds}: ggml", file=sys.stderr)
        g = ggml_round(a.ggml_bin, tokens)
        print(f"cpu-peer: round {r + 1}/{a.rounds}: cpu_bench", file=sys.stderr)
        o = ours_round(ours_bin, a.runs, os.path.join(ROOT, "bench/results/cpu_peer.tmp"))
        rounds.append({"ggml": {str(n): v for n, v in g.items()}, "ours": o})
    # Our 1-token point comparable with ggml's: warm (ggml repeats one graph, so its 17.6 MB of
    # weights sit in L3 as ours do with weights=warm); 512 tokens: both kernels of ours.
    pairs = {"1": ["1_warm", "1_cold"], "512": ["512_int16", "512_int8"]}
    summary = {}
    for n, ours_keys in pairs.items():
        g = statistics.median(r["ggml"][n]["us_per_run"] for r in rounds)
        entry = {"ggml_median_us": g}
        for k in ours_keys:
            o = statistics.median(r["ours"]["points_us"][k] for r in rounds)
            per_round = [r["ggml"][n]["us_per_run"] / r["ours"]["points_us"][k] for r in rounds]
            entry[k] = {"ours_median_us": o, "ggml_over_ours": g / o,
                        "ggml_over_ours_per_round": per_round}
        summary[n] = entry
    out = {
        "benchmark": "cpu_peer_ggml",
        "date": datetime.date.today().strftime("%Y%m%d"),
        "commit": commit,
        "ggml_commit": a.ggml_commit,
        "machine": host(),
        "definitions": "Problem D (MXFP4 2880x2880, E=32, top-4, fp32 activations) as ggml's "
                       "test-backend-ops perf case MUL_MAT_ID(" + CASE.format(n="N") + ") and as "
                       "cpu_bench --sections=problem_d, alternating round by round on one host, all "
                       "hardware threads each. ggml: us/run as it prints it (it repeats one graph, "
                       "weights warm in cache at 1 token). Ours: medians of cpu_bench's points "
                       "(1_warm is the comparable 1-token point; 1_cold reads the weights from DRAM). "
                       "ggml_over_ours > 1: ours is faster by that factor.",
        "rounds": rounds,
        "summary": summary,
    }
    path = a.out_json or os.path.join(ROOT, "bench/results", f"cpu_peer_ggml_{out['date']}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    for n, e in summary.items():
        for k, v in e.items():
            if isinstance(v, dict):
                print(f"problem D, {n} token(s): ggml {e['ggml_median_us']:.1f} us, ours ({k}) "
                      f"{v['ours_median_us']:.1f} us: {v['ggml_over_ours']:.2f}x "
                      f"(per round {', '.join(f'{x:.2f}' for x in v['ggml_over_ours_per_round'])})")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
