"""Build hook of moe-serve-client: generates the gRPC stubs of proto/moe/v1 while building.

`build_py` runs protoc with --python_out and grpc_python_plugin on the repository's proto/ directory
(or $MOE_PROTO_DIR, or a proto/ directory next to this file) and writes the modules into
moe_serve_client/_generated/moe/v1/ of the build tree, with their cross-imports pointing into that
package, so the installed package never imports a top-level `moe` module. Everything else is
declared in pyproject.toml.
"""

import os
import re
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTOS = ("tensor.proto", "shard.proto", "coordinator.proto", "tcp.proto")
PACKAGE = "moe_serve_client._generated"


def proto_root():
    candidates = [os.environ.get("MOE_PROTO_DIR", ""), os.path.join(HERE, "proto"),
                  os.path.join(HERE, "..", "..", "proto")]
    for root in candidates:
        if root and all(os.path.isfile(os.path.join(root, "moe", "v1", p)) for p in PROTOS):
            return os.path.abspath(root)
    raise RuntimeError("moe/v1 protos not found in %s (set MOE_PROTO_DIR)" % candidates)


def tool(name):
    path = shutil.which(name) or os.path.join("/usr/bin", name)
    if not os.path.exists(path):
        raise RuntimeError("%s not found: install Debian's protobuf-compiler and "
                           "protobuf-compiler-grpc" % name)
    return path


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        out = os.path.join(self.build_lib, *PACKAGE.split("."))
        os.makedirs(out, exist_ok=True)
        root = proto_root()
        subprocess.check_call(
            [tool("protoc"), "-I", root, "--python_out=" + out, "--grpc_out=" + out,
             "--plugin=protoc-gen-grpc=" + tool("grpc_python_plugin")] +
            [os.path.join(root, "moe", "v1", p) for p in PROTOS])
        generated = os.path.join(out, "moe", "v1")
        for directory in (out, os.path.join(out, "moe"), generated):
            open(os.path.join(directory, "__init__.py"), "a").close()
        # `from moe.v1 import x_pb2` -> `from moe_serve_client._generated.moe.v1 import x_pb2`
        for name in os.listdir(generated):
            path = os.path.join(generated, name)
            with open(path) as f:
                text = f.read()
            text = re.sub(r"^from moe\.v1 import ", "from %s.moe.v1 import " % PACKAGE, text,
                          flags=re.M)
            with open(path, "w") as f:
                f.write(text)


setup(cmdclass={"build_py": BuildWithStubs})
