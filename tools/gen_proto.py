"""Regenerate the committed Python code for proto/tandem/v1/*.proto.

Usage: python tools/gen_proto.py [OUT_DIR]   (default: common/pb; `make proto` runs it)

protoc writes imports as `from tandem.v1 import x_pb2`, mirroring the .proto import
paths; they are rewritten to `from common.pb.tandem.v1 import x_pb2` so the generated
modules live inside the `common` package (a top-level `proto` or `tandem` package would
clash with `proto-plus` and with nothing else needing that name).
tests/test_proto_fresh.py regenerates into a temporary folder and fails when it differs.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
_IMPORT = re.compile(r"^from tandem\.v1 import ", re.MULTILINE)


def generate(out_dir: Path) -> list[Path]:
    """Generate *_pb2.py, *_pb2.pyi and *_pb2_grpc.py into out_dir/tandem/v1; return the files."""
    target = out_dir / "tandem" / "v1"
    target.mkdir(parents=True, exist_ok=True)
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "tandem" / "v1").glob("*.proto"))
    args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    files = sorted(p for p in target.iterdir() if p.suffix in (".py", ".pyi") and p.name != "__init__.py")
    for path in files:
        text = _IMPORT.sub("from common.pb.tandem.v1 import ", path.read_text())
        path.write_text(text)
    for pkg in (out_dir / "tandem", target):
        (pkg / "__init__.py").touch()
    return files


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "common" / "pb"
    for f in generate(out):
        print(f.relative_to(out))
