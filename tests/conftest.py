import gc

import pytest
import torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def report():
    """The report of 3 AdamW steps of tests/models.py's mlp() on a 512x512 batch, tracked on the CPU."""
    import memprof
    from models import mlp, train

    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    with memprof.track(model) as prof:
        train(model, opt, torch.randn(512, 512), 3)
    return prof.report()


@pytest.fixture(autouse=True)
def _collect():
    yield
    gc.collect()
    # The GPU tests share one device: what a test left cached (an out-of-memory
    # test reserves most of it) would make the next one's scripts run out early.
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
