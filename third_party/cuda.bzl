"""cuda_library: compiles .cu files with nvcc for Hopper (sm_90a SASS plus compute_90a PTX).

Each .cu file becomes one object through a genrule; a cc_library links the objects with the static
CUDA runtime, so binaries start on machines without a GPU. Under `--config=nocuda` the library
holds `nocuda_srcs` instead (host code that reports "built without CUDA"), and no nvcc runs.
Device code includes only headers named in `hdrs`/`cu_hdrs` (no abseil, no protobuf, no gRPC).
"""

NVCC = "/usr/local/cuda/bin/nvcc"

NVCC_FLAGS = [
    "-std=c++20",
    "-O3",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_90a,code=compute_90a",
    "--expt-relaxed-constexpr",
    "-Xcompiler=-fPIC",
    "-Xptxas=-warn-spills",
    "-lineinfo",
]

def cuda_library(name, srcs, hdrs = [], cu_hdrs = [], nocuda_srcs = [], deps = [], use_cutlass = False, copts = [], **kwargs):
    objs = []
    extra_inputs = list(hdrs) + list(cu_hdrs)
    includes = "-I. -I$(GENDIR)"
    if use_cutlass:
        extra_inputs.append("@cutlass//:headers")
        includes += " -Iexternal/cutlass/include"
    for src in srcs:
        stem = src.replace("/", "_").replace(".cu", "")
        obj = "_cuda_objs/%s/%s.pic.o" % (name, stem)
        native.genrule(
            name = "%s_%s_nvcc" % (name, stem),
            srcs = [src] + extra_inputs,
            outs = [obj],
            cmd = "%s %s %s %s -c $(location %s) -o $@" % (
                NVCC,
                " ".join(NVCC_FLAGS + copts),
                includes,
                "-DMOE_HAVE_CUDA=1",
                src,
            ),
            tags = ["manual"],
            message = "nvcc sm_90a %s" % src,
        )
        objs.append(obj)
    native.cc_library(
        name = name,
        srcs = select({
            "//third_party:cuda_disabled": nocuda_srcs,
            "//conditions:default": objs,
        }),
        hdrs = hdrs,
        deps = deps + select({
            "//third_party:cuda_disabled": [],
            "//conditions:default": ["@cuda//:cudart_static"],
        }),
        alwayslink = True,
        linkstatic = True,
        **kwargs
    )
