import os

import pytest
import torch

# The app's pairs decode eagerly in tests: building captured steps means minutes of compiling in a background
# process, which tests/test_ui_capture.py exercises on its own (tests/test_captured_steps.py covers the engine's side).
os.environ.setdefault("TREEVIZ_CAPTURE", "off")

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
