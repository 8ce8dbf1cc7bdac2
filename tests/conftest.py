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
