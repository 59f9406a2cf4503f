import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
