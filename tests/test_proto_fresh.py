"""The committed generated code must equal what `make proto` generates now."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_fresh(tmp_path):
    # protoc runs in its own process: grpc_tools' bundled protobuf can crash a process that
    # has already loaded many other extension modules.
    subprocess.run([sys.executable, str(ROOT / "tools" / "gen_proto.py"), str(tmp_path)], check=True,
                   capture_output=True, timeout=120)
    fresh = {p.name: p for p in (tmp_path / "tandem" / "v1").glob("*_pb2*")}
    committed = {p.name: p for p in (ROOT / "common" / "pb" / "tandem" / "v1").glob("*_pb2*")}
    stale = sorted(n for n in fresh if n not in committed or committed[n].read_text() != fresh[n].read_text())
    extra = sorted(set(committed) - set(fresh))
    assert fresh and not stale and not extra, f"run `make proto`: stale {stale}, no longer generated {extra}"
