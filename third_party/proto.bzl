"""moe_proto_library: protoc + grpc_cpp_plugin (both from Debian) into one cc_library.

Proto files live under proto/ and import each other as "moe/v1/x.proto"; generated headers are
included the same way ("moe/v1/x.pb.h").
"""

def moe_proto_library(name, srcs, deps = [], **kwargs):
    outs = []
    for src in srcs:
        base = src[:-len(".proto")]
        outs += [base + ".pb.h", base + ".pb.cc", base + ".grpc.pb.h", base + ".grpc.pb.cc"]
    pkg = native.package_name()
    native.genrule(
        name = name + "_gen",
        srcs = srcs,
        outs = outs,
        cmd = ("/usr/bin/protoc -I%s --cpp_out=$(GENDIR)/%s --grpc_out=$(GENDIR)/%s " +
               "--plugin=protoc-gen-grpc=/usr/bin/grpc_cpp_plugin $(SRCS)") % (pkg, pkg, pkg),
        message = "protoc " + name,
    )
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")],
        includes = ["."],
        copts = ["-Wno-unused-parameter"],
        deps = deps + ["@system//:grpc++"],
        **kwargs
    )
