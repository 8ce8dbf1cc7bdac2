import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Workers started as processes (`--device auto` picks a GPU when there is one) stay on the CPU in
# float32, so their tokens can equal reference_generate's on a GPU machine too.
os.environ.setdefault("TANDEM_DEVICE", "cpu")


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
