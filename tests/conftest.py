import multiprocessing.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Workers started as processes (`--device auto` picks a GPU when there is one) stay on the CPU in
# float32, so their tokens can equal reference_generate's on a GPU machine too.
os.environ.setdefault("TANDEM_DEVICE", "cpu")

# Every temporary folder the run's clusters make — `tandem up`'s and the demo's log folders,
# etcd's data — under one folder: removed when the run passes, kept (and named) when it fails,
# so a passing `make test` leaves nothing behind in /tmp. Processes the tests start inherit it.
# pytest's own tmp_path folders stay where they were (their paths' length matters to tests of
# unix socket paths) and pytest keeps only its last three runs of them.
RUN_TMP: str | None = None


def pytest_sessionstart(session):
    global RUN_TMP
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    # multiprocessing makes its own pymp-* folder once and removes it at interpreter exit; made
    # inside RUN_TMP it would be gone by then and its finalizer would print a traceback.
    multiprocessing.util.get_temp_dir()
    RUN_TMP = tempfile.mkdtemp(prefix="tandem-tests-")
    os.environ["TMPDIR"] = RUN_TMP
    tempfile.tempdir = RUN_TMP


def pytest_sessionfinish(session, exitstatus):
    if RUN_TMP is None:
        return
    if exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        shutil.rmtree(RUN_TMP, ignore_errors=True)
    else:
        print(f"\nthe run's temporary files (logs of the clusters it started): {RUN_TMP}", file=sys.stderr)


@pytest.fixture(scope="session")
def etcd_server():
    from discovery.etcd_server import EtcdServer
    with EtcdServer() as server:
        yield server


@pytest.fixture(scope="session")
def tiny_model():
    import torch
    torch.set_num_threads(1)
    from engine.model_source import TINY, load_model
    return load_model(TINY)


@pytest.fixture(scope="module")
def one_torch_thread():
    """On a busy 2-core machine torch's intra-op thread pool makes tiny ops up to 30x slower."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
