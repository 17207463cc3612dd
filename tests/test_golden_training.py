"""Refactoring guard: every method's two training steps are bit-identical to the ones recorded before a change.

Each configuration of `tests/launch/tiny_tree_run.py` (the named methods and the mixed compositions) trains two
optimizer blocks of one generation batch from the cached warm start, with real sampling. The test records, per
optimizer step, the loss each micro-batch returned and a digest of every trainable parameter after the step: equal
digests after an Adam step mean equal gradients, so the pair pins sampling, credit, packing, the loss and its gradient
at once. A change that is meant to keep behaviour (docs/design.md: the architecture of #29) must keep this file's
record; a change that is meant to alter the numbers regenerates it, and says why in its commit:

    python -m tests.test_golden_training --update

The configurations are `tests/launch/tiny_tree_run.CONFIGURATIONS`, which must train every registered sampler,
credit and loss. A new one (a composition added there for a newly registered component) is recorded alone, leaving
the others' records as they are:

    python -m tests.test_golden_training --add NAME

Bits depend on the CPU's vector kernels: the record notes `torch.backends.cpu.get_cpu_capability()` and the torch
version, and a machine with other kernels compares the losses to 1e-4 instead of the digests bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.launch.tiny_tree_run import CONFIGURATIONS, build_trainer, uncovered

RECORD = Path(__file__).parent / "data" / "golden_training.json"


def _kernels() -> str:
    return f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}"


def two_steps(name: str, out: str, **config_fields) -> dict:
    """The losses and parameter digests of two optimizer steps of configuration `name`."""
    trainer = build_trainer(out, max_steps=2, method=name, **config_fields)
    losses: list[float] = []
    compute_loss = trainer.compute_loss

    def recording(*args, **kwargs):
        loss = compute_loss(*args, **kwargs)
        losses.append(float(loss.detach()))
        return loss

    digests: list[str] = []

    def digest(optimizer, args, kwargs):
        h = hashlib.sha256()
        for n, p in trainer.model.named_parameters():
            if p.requires_grad:
                h.update(n.encode())
                h.update(p.detach().cpu().contiguous().numpy().tobytes())
        digests.append(h.hexdigest())

    trainer.compute_loss = recording
    trainer.create_optimizer()
    trainer.optimizer.register_step_post_hook(digest)
    trainer.train()
    return {"losses": [repr(v) for v in losses], "digests": digests}


@pytest.fixture(scope="module")
def record() -> dict:
    if not RECORD.exists():
        pytest.fail(f"{RECORD} is missing: run `python {Path(__file__).relative_to(Path.cwd())} --update`.")
    return json.loads(RECORD.read_text())


def test_every_registered_component_is_in_the_record():
    """A newly registered sampler, credit or loss is pinned once a configuration trains it."""
    assert not uncovered(CONFIGURATIONS), "\n".join(uncovered(CONFIGURATIONS))


@pytest.mark.parametrize("name", CONFIGURATIONS)
def test_two_training_steps_match_the_record(tmp_path, record, name):
    if name not in record["runs"]:
        pytest.fail(f"{name!r} has no golden record: record it with `python -m tests.test_golden_training --add "
                    f"{name}` (the others' records stay as they are) and commit {RECORD.name}.")
    got, want = two_steps(name, str(tmp_path)), record["runs"][name]
    assert len(got["digests"]) == 2 and len(got["losses"]) >= 2
    if record["kernels"] == _kernels():
        assert got == want, f"{name}: training changed; if that is intended, rerun with --update and say why"
    else:  # other vector kernels: the same numbers up to rounding
        assert [float(v) for v in got["losses"]] == pytest.approx([float(v) for v in want["losses"]], rel=1e-4)


def test_one_tool_call_at_a_time_trains_as_the_concurrent_default(tmp_path, record):
    """`max_concurrent_tool_calls=1` runs a round's calls one after another (as before calls ran concurrently), the
    default runs them together: the record, made either way, is the same bits."""
    got, want = two_steps("treeopsd", str(tmp_path), max_concurrent_tool_calls=1), record["runs"]["treeopsd"]
    if record["kernels"] == _kernels():
        assert got == want
    else:
        assert [float(v) for v in got["losses"]] == pytest.approx([float(v) for v in want["losses"]], rel=1e-4)


if __name__ == "__main__":
    import tempfile

    if sys.argv[1:] == ["--update"]:
        names, runs = CONFIGURATIONS, {}
    elif sys.argv[1:2] == ["--add"] and sys.argv[2:] and set(sys.argv[2:]) <= set(CONFIGURATIONS):
        recorded = json.loads(RECORD.read_text())
        if recorded["kernels"] != _kernels():  # the new runs' bits would not be comparable with the others'
            raise SystemExit(f"{RECORD.name} was made with {recorded['kernels']}, this machine has {_kernels()}: "
                             "add the configuration on a machine with the record's kernels.")
        names, runs = sys.argv[2:], recorded["runs"]
    else:
        raise SystemExit(__doc__)
    torch.set_num_threads(1)  # as the suite runs (tests/conftest.py)
    for name in names:
        with tempfile.TemporaryDirectory() as out:
            runs[name] = two_steps(name, out)
        print(name, runs[name]["losses"], flush=True)
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(json.dumps({"kernels": _kernels(), "runs": runs}, indent=1) + "\n")
    print("wrote", RECORD)
