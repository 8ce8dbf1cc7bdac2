"""The committed generated code must equal what `make proto` generates now."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_fresh(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "tools" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    files = gen.generate(tmp_path)
    committed = ROOT / "common" / "pb" / "tandem" / "v1"
    stale = [f.name for f in files if (committed / f.name).read_text() != f.read_text()]
    extra = sorted({p.name for p in committed.glob("*_pb2*")} - {f.name for f in files})
    assert not stale and not extra, f"run `make proto`: stale {stale}, no longer generated {extra}"
