import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """The tiny model's matrices are too small to split across cores: with the cores shared by other jobs, one
    intra-op thread per process is much faster than contended threads (benchmarks/README.md, section 5)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def event_loop_thread():
    """GRPOTrainer's event loop for async tools: a daemon thread running one loop for the whole run."""
    from trl.trainer.utils import shutdown_event_loop_in_daemon, start_event_loop_in_daemon

    thread, loop, ready = start_event_loop_in_daemon(name="tests-async-tools")
    ready.wait()
    yield loop
    shutdown_event_loop_in_daemon(thread, loop)


@pytest.fixture
def benchmark_script(monkeypatch):
    """`benchmark_script("bench_blocks")`: a script under `benchmarks/` as a module (the scripts import `common` from
    their folder), fresh for this test and gone after it."""
    import importlib
    import sys
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "benchmarks"
    monkeypatch.syspath_prepend(str(folder))
    names = ("common", "bench_learning", "bench_blocks")

    def load(name: str):
        for cached in names:
            monkeypatch.delitem(sys.modules, cached, raising=False)
        return importlib.import_module(name)

    yield load
    for cached in names:
        sys.modules.pop(cached, None)


@pytest.fixture
def loss_table():
    """`trl_tree.methods.LOSSES` as it was before the test, whatever the test registered (the registry tests of
    test_methods.py and test_stale_losses.py)."""
    from trl_tree import methods

    before = dict(methods.LOSSES)
    yield methods.LOSSES
    methods.LOSSES.clear()
    methods.LOSSES.update(before)
