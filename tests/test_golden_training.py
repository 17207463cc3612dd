"""Refactoring guards: two golden records of training, one every machine compares and one per machine, bit for bit.

**Every machine** (`tests/data/golden_float64.json`, `tests/golden_float64.py`): every (credit, loss) pair of the
registries trains two optimizer blocks of SGD, in float64, on stored trees and TreeFlex groups, from a model whose
parameters are exact dyadic rationals: no sampling, nothing a machine's kernels computed to start from. The packed
micro-batches and the credit's integer fields are compared exactly; the credit's floats, π_old, and per block the
loss, its metrics and the gradient (norm, projection) to a relative 1e-9, where machines' kernels differ by ~1e-14
(`golden_float64.SPREAD`). So a change of behaviour of packing, π_old's forward, a credit, a loss's `prepare` or its
loss fails here on whatever machine CI runs, and the test shows it by running the record once more with ATen's plain
kernels (a machine of another fingerprint, which the bitwise record skips). A change meant to alter the numbers
regenerates it and says why in its commit:

    python -m tests.test_golden_training --update-float64

A newly registered credit or loss adds its pairs (`golden_float64.configurations`), which fail until recorded; the
others' records stay as they are when regenerated.

**Per machine, bit for bit** (`tests/data/golden_training.json`): each configuration of `tests/launch/tiny_tree_run.py`
(the named methods and the mixed compositions) trains two optimizer blocks of one generation batch from the cached
warm start, with real sampling and TRL's AdamW. The test records, per optimizer step, the loss each micro-batch
returned and a digest of every trainable parameter after the step: equal digests after an Adam step mean equal
gradients, so the pair pins sampling, credit, packing, the loss and its gradient at once. A change that is meant to
keep behaviour (docs/design.md: the architecture of #29) must keep this file's record; a change that is meant to alter
the numbers regenerates it, and says why in its commit:

    python -m tests.test_golden_training --update

The configurations are `tests/launch/tiny_tree_run.CONFIGURATIONS`, which must train every registered sampler,
credit and loss. A new one (a composition added there for a newly registered component) is recorded alone, leaving
the others' records as they are:

    python -m tests.test_golden_training --add NAME

Bits depend on how the machine's kernels round, and sampling turns a last-bit difference into other tokens, so another
machine's steps are not comparable at all, not even their losses. The file holds one record per machine kind, keyed by
`trl_tree.testing.kernel_fingerprint()` (what three AdamW steps of the tiny model compute here; the CPU capability
alone does not tell: two AVX512 machines differed). A machine with no record skips this comparison (the float64
record still guards it) and says so; to add its record beside the others, on a clean checkout whose record passes
elsewhere:

    python -m tests.test_golden_training --add-machine
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import golden_float64
from tests.launch.tiny_tree_run import CONFIGURATIONS, build_trainer, components, uncovered
from trl_tree import methods
from trl_tree.testing import kernel_fingerprint
from trl_tree.trainer.async_rollouts import use_rollout_worker

RECORD = Path(__file__).parent / "data" / "golden_training.json"


def _machine() -> dict:
    """What identifies this machine's bits (`fingerprint`), and, for a reader, its torch and vector unit."""
    return {"fingerprint": kernel_fingerprint(),
            "kernels": f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}"}


def two_steps(name: str, out: str, through_worker: bool = False, **config_fields) -> dict:
    """The losses and parameter digests of two optimizer steps of configuration `name`; `through_worker`: its
    generation batch grown by the rollout worker in lockstep (max_staleness 0, docs/design.md §9)."""
    trainer = build_trainer(out, max_steps=2, method=name, **config_fields)
    if through_worker:
        use_rollout_worker(trainer, 0)
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
    """This machine's record: the runs of every configuration, as this machine's kernels compute them."""
    if not RECORD.exists():
        pytest.fail(f"{RECORD} is missing: run `python -m tests.test_golden_training --update`.")
    machine, records = _machine(), json.loads(RECORD.read_text())["records"]
    mine = [r for r in records if r["fingerprint"] == machine["fingerprint"]]
    if not mine:
        known = "; ".join(f"{r['fingerprint']} ({r['kernels']})" for r in records)
        pytest.skip(f"{RECORD.name} holds the training bits of other machines ({known}); this one computes "
                    f"{machine['fingerprint']} ({machine['kernels']}), whose bits they cannot be compared with. Add its "
                    "record on a clean checkout: python -m tests.test_golden_training --add-machine")
    return mine[0]["runs"]


# ---------------------------------------------------------------------------------------------------------------
# The record every machine compares (float64, stored units)
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def float64_record() -> dict:
    if not golden_float64.RECORD.exists():
        pytest.fail(f"{golden_float64.RECORD} is missing: python -m tests.test_golden_training --update-float64")
    return json.loads(golden_float64.RECORD.read_text())["runs"]


def test_every_registered_credit_and_loss_pair_is_in_the_float64_record(float64_record):
    """A newly registered credit or loss is pinned on every machine once its pairs are recorded."""
    names = set(golden_float64.configurations())
    missing, stale = sorted(names - set(float64_record)), sorted(set(float64_record) - names)
    assert not missing, (f"{missing} have no float64 record: record them with `python -m tests.test_golden_training "
                         "--update-float64` (the other pairs' records stay as they are) and commit it.")
    assert not stale, f"{stale} are recorded but no longer registered: regenerate with --update-float64."


@pytest.mark.parametrize("name", list(golden_float64.configurations()))
def test_two_float64_blocks_match_the_record_on_every_machine(float64_record, name):
    if name not in float64_record:
        pytest.fail(f"{name!r} has no float64 record: python -m tests.test_golden_training --update-float64")
    differences = golden_float64.differences(golden_float64.run(*golden_float64.configurations()[name]),
                                             float64_record[name])
    assert not differences, (f"{name}: training changed ({len(differences)} values); if that is intended, rerun with "
                             "--update-float64 and say why:\n" + "\n".join(differences[:20]))


def test_the_float64_record_holds_with_other_kernels_where_the_bitwise_one_skips():
    """ATen's plain kernels (what a machine without AVX computes; another `kernel_fingerprint`, so the bitwise record
    would skip there) sum in other orders: the float64 record still holds, to its tolerance. (Two threads, another
    order again, matched too when `SPREAD` was measured; not rerun here, where threads contend with other work.)"""
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("ATen's kernels here are the plain ones already: the parametrized test above ran them")
    done = subprocess.run([sys.executable, "-m", "tests.test_golden_training", "--check-float64"], text=True,
                          capture_output=True, env={**os.environ, "ATEN_CPU_CAPABILITY": "default"},
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "kernels: DEFAULT" in done.stdout  # it did run with other kernels, not skip


def test_a_change_of_one_part_in_a_hundred_million_to_a_loss_fails_the_record(float64_record, monkeypatch):
    """The tolerance guards behaviour: TreeOPSD's loss scaled by 1 + 1e-8 (as a changed constant would) fails both
    blocks' losses and gradients, while the packing and the credit, which it does not touch, still match."""
    from dataclasses import replace

    from trl_tree import methods

    entry = methods.LOSSES["treeopsd"]

    def scaled(batch, args):
        value, metrics = entry.compute(batch, args)
        return value * (1 + 1e-8), metrics

    monkeypatch.setitem(methods.LOSSES, "treeopsd", replace(entry, compute=scaled))
    name = "likelihood+treeopsd"
    differences = golden_float64.differences(golden_float64.run(*golden_float64.configurations()[name]),
                                             float64_record[name])
    changed = {d.split(":")[0] for d in differences}
    assert {"blocks[0].loss", "blocks[0].grad_norm", "blocks[1].loss", "blocks[1].grad_norm"} <= changed
    assert not any(d.startswith(("packed", "credit", "old_logps")) for d in changed)


# ---------------------------------------------------------------------------------------------------------------
# The record per machine (bit for bit, sampled)
# ---------------------------------------------------------------------------------------------------------------


def test_every_registered_component_is_in_the_record():
    """A newly registered sampler, credit or loss is pinned once a configuration trains it."""
    assert not uncovered(CONFIGURATIONS), "\n".join(uncovered(CONFIGURATIONS))


def test_the_fingerprint_tells_other_kernels_apart():
    """The key of a record is a property of the kernels: the same on a second call, and other when ATen's vectorised
    kernels are replaced by plain ones (the difference between two machines' vector units)."""
    first = kernel_fingerprint()
    assert kernel_fingerprint.__wrapped__() == first  # computed again, not the process's cached value
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("ATen's kernels here are the plain ones already: no other kernels to tell apart")
    plain = subprocess.run([sys.executable, "-c", "from trl_tree.testing import kernel_fingerprint as k; print(k())"],
                           env={**os.environ, "ATEN_CPU_CAPABILITY": "default"}, capture_output=True, text=True,
                           check=True).stdout.split()[-1]
    assert plain != first


@pytest.mark.parametrize("name", CONFIGURATIONS)
def test_two_training_steps_match_the_record(tmp_path, record, name):
    if name not in record:
        pytest.fail(f"{name!r} has no golden record: record it with `python -m tests.test_golden_training --add "
                    f"{name}` (the others' records stay as they are) and commit {RECORD.name}.")
    got = two_steps(name, str(tmp_path))
    assert len(got["digests"]) == 2 and len(got["losses"]) >= 2
    assert got == record[name], f"{name}: training changed; if that is intended, rerun with --update and say why"


@pytest.mark.parametrize("name", [n for n in CONFIGURATIONS if methods.SAMPLERS[components(n)["sampler"]].unit == "tree"])
def test_the_rollout_worker_at_staleness_0_trains_the_record(tmp_path, name):
    """Asynchronous rollouts at max_staleness 0 (the worker's own policy copy, turn loop, sampler and scorer; π_old
    recomputed by the trainer) train the golden record's bits, for every configuration that grows trees (TreeFlex is
    refused). On a machine without a record the synchronous run computed here stands in for it."""
    records = [r for r in json.loads(RECORD.read_text())["records"] if r["fingerprint"] == _machine()["fingerprint"]]
    want = records[0]["runs"][name] if records else two_steps(name, str(tmp_path / "sync"))
    assert two_steps(name, str(tmp_path / "worker"), through_worker=True) == want


def test_one_tool_call_at_a_time_trains_as_the_concurrent_default(tmp_path, record):
    """`max_concurrent_tool_calls=1` runs a round's calls one after another (as before calls ran concurrently), the
    default runs them together: the record, made either way, is the same bits."""
    assert two_steps("treeopsd", str(tmp_path), max_concurrent_tool_calls=1) == record["treeopsd"]


def test_records_are_kept_per_machine(tmp_path, monkeypatch):
    """`--add-machine` puts a second machine's record beside the first; `--update` (an intended change) leaves only
    the updating machine's; `--add` refuses a machine without a record (its bits would sit beside other bits)."""
    module = sys.modules[__name__]
    machine = {"fingerprint": "a", "kernels": "torch, AVX512"}
    monkeypatch.setattr(module, "RECORD", tmp_path / "golden.json")
    monkeypatch.setattr(module, "_machine", lambda: dict(machine))
    monkeypatch.setattr(module, "two_steps", lambda name, out: {"losses": [machine["fingerprint"]], "digests": []})
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)

    def fingerprints():
        return [(r["fingerprint"], sorted(r["runs"])) for r in json.loads(module.RECORD.read_text())["records"]]

    main(["--update"])
    assert fingerprints() == [("a", sorted(CONFIGURATIONS))]
    machine["fingerprint"] = "b"
    with pytest.raises(SystemExit, match="no record for this machine"):
        main(["--add", CONFIGURATIONS[0]])
    main(["--add-machine"])
    assert fingerprints() == [("a", sorted(CONFIGURATIONS)), ("b", sorted(CONFIGURATIONS))]
    with pytest.raises(SystemExit, match="already holds"):
        main(["--add-machine"])
    main(["--update"])
    assert fingerprints() == [("b", sorted(CONFIGURATIONS))]


def _float64(option: str) -> None:
    """`--update-float64`: the record every machine compares, of every registered pair. `--check-float64`: compare
    this machine's runs with it, exit status 1 and the differences when any differs."""
    torch.set_num_threads(1)  # as the suite runs (tests/conftest.py)
    print(f"kernels: {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads", flush=True)
    runs = {name: golden_float64.run(*pair) for name, pair in golden_float64.configurations().items()}
    if option == "--check-float64":
        recorded = json.loads(golden_float64.RECORD.read_text())["runs"]
        differences = golden_float64.differences(runs, recorded)
        print("\n".join(differences[:40]) or "the float64 record holds")
        raise SystemExit(1 if differences else 0)
    about = ("The golden training record every machine compares: tests/golden_float64.py says what it holds, "
             "tests/test_golden_training.py how it is compared and regenerated.")
    record = {"about": about, "rtol": golden_float64.RTOL, "atol": golden_float64.ATOL, "runs": runs}
    golden_float64.RECORD.write_text(json.dumps(record, indent=1) + "\n")
    print("wrote", golden_float64.RECORD)


def main(argv: list[str]) -> None:
    """`--update`: this machine's record of every configuration, alone (an intended change leaves every other
    machine's bits stale). `--add NAME...`: configurations added to this machine's record. `--add-machine`: this
    machine's record of every configuration, beside the others' (the code unchanged). `--update-float64`,
    `--check-float64`: the record every machine compares (`_float64`)."""
    import tempfile

    if argv in (["--update-float64"], ["--check-float64"]):
        return _float64(argv[0])
    machine = _machine()
    # (a file from before per-machine records has no "records": it holds nothing a fingerprint can match)
    records = json.loads(RECORD.read_text()).get("records", []) if RECORD.exists() else []
    mine = next((r for r in records if r["fingerprint"] == machine["fingerprint"]), None)
    if argv == ["--update"]:
        names, records, mine = CONFIGURATIONS, [], None
    elif argv == ["--add-machine"]:
        if mine is not None:
            raise SystemExit(f"{RECORD.name} already holds this machine's record ({machine['fingerprint']}).")
        names = CONFIGURATIONS
    elif argv[:1] == ["--add"] and argv[1:] and set(argv[1:]) <= set(CONFIGURATIONS):
        if mine is None:  # the new runs' bits would not be comparable with the others'
            raise SystemExit(f"{RECORD.name} has no record for this machine's kernels ({machine['fingerprint']}, "
                             f"{machine['kernels']}): add the configuration on a machine it has a record for.")
        names = argv[1:]
    else:
        raise SystemExit(__doc__)
    if mine is None:
        mine = {**machine, "runs": {}}
        records.append(mine)
    torch.set_num_threads(1)  # as the suite runs (tests/conftest.py)
    for name in names:
        with tempfile.TemporaryDirectory() as out:
            mine["runs"][name] = two_steps(name, out)
        print(name, mine["runs"][name]["losses"], flush=True)
    RECORD.parent.mkdir(exist_ok=True)
    RECORD.write_text(json.dumps({"records": records}, indent=1) + "\n")
    print("wrote", RECORD)


if __name__ == "__main__":
    main(sys.argv[1:])
