import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


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
