import pytest
import torch

from engine.models import tiny_random_pair

# Tiny models are all per-call overhead: extra threads only add contention. Real-model tests raise this.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def related_pair():
    return tiny_random_pair("related", seed=0, dtype=torch.float32)


@pytest.fixture(scope="session")
def identical_pair():
    return tiny_random_pair("identical", seed=0, dtype=torch.float32)


@pytest.fixture(scope="session")
def unrelated_pair():
    return tiny_random_pair("unrelated", seed=0, dtype=torch.float32)
