"""A scripted TreeOPSD run with `log_completions=True` that reports to real trackers, for tests/test_tree_view_trackers.py.

Usage: python tests/launch/tree_view_tracker_run.py OUT TRACKERS MAX_STEPS
       (TRACKERS: "trackio", "wandb" or "trackio,wandb")

Trackio writes to its local store under OUT/trackio and W&B runs offline under OUT (set here, before either is imported:
Trackio reads `TRACKIO_DIR` at import time, and TRL imports it with the trainer). Writes OUT/report.json: the steps
of the saved pages and what each tracker stored (its rows: step, keys, the global step, the logged page's HTML).
"""

import json
import os
import sys
from pathlib import Path

OUT, TRACKERS, MAX_STEPS = Path(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[3])
os.environ.update(TRACKIO_DIR=str(OUT / "trackio"), WANDB_MODE="offline", WANDB_DIR=str(OUT), WANDB_SILENT="true",
                  TRL_EXPERIMENTAL_SILENCE="1", WANDB_DISABLE_GIT="true")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.scripted import REPLIES, arithmetic_dataset, config, contains_answer, scripted_engine, tiny  # noqa: E402
from trl_tree import TreeOPSDConfig, TreeOPSDTrainer  # noqa: E402
from trl_tree.testing import calculator  # noqa: E402

PROJECT, RUN = "tree-view-test", "run"
MEDIA = ("tree_view", "completions")  # W&B stores a media value as nested keys (tree_view/path, ...)


def train() -> TreeOPSDTrainer:
    model, tok = tiny()
    # two optimizer steps per generation batch: one page per two steps, as in the issue (pages at 2, 4, ...)
    args = config(TreeOPSDConfig, OUT, log_completions=True, steps_per_generation=2, max_steps=MAX_STEPS,
                  report_to=TRACKERS, project=PROJECT, run_name=RUN)
    trainer = TreeOPSDTrainer(model=model, reward_funcs=contains_answer, args=args,
                              train_dataset=arithmetic_dataset(MAX_STEPS), processing_class=tok, tools=[calculator])
    # the scripted leaves mix tool calls and plain answers: the completions table W&B could not type
    trainer.generation_engine = scripted_engine(tok, {k: v * 4 * MAX_STEPS for k, v in REPLIES.items()})
    trainer.train()
    return trainer


def trackio_rows() -> list[dict]:
    from trackio.sqlite_storage import SQLiteStorage

    rows = []
    for row in SQLiteStorage.get_logs(PROJECT, RUN):
        entry = {"step": row.get("step"), "keys": sorted(k for k in row if k not in ("step", "timestamp")),
                 "global_step": row.get("train/global_step")}
        page = row.get("tree_view")
        if isinstance(page, dict):
            entry["page_meta"] = {k: v for k, v in page.items() if isinstance(v, (str, int, float))}
            found = sorted((OUT / "trackio").rglob(Path(str(page.get("file_path", ""))).name or "-"))
            entry["page"] = found[0].read_text(encoding="utf-8") if found else None
        rows.append(entry)
    return rows


def wandb_rows(wait_s: float = 120.0) -> list[dict]:
    """The history rows of the offline run file, once W&B's writer has finished it (its exit record is written):
    `wandb.finish()` hands the last records to W&B's service process, which writes them on its own time (on loaded
    cores the last page's row came seconds later, so reading at once lost it)."""
    import time

    (run_file,) = OUT.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + wait_s
    while True:
        records = _wandb_records(run_file.read_bytes())
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{run_file} has no exit record {wait_s:.0f} s after wandb.finish(): W&B's writer did "
                               "not finish the run file, so its rows cannot be checked")
        time.sleep(0.5)
    rows = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            entry = {"step": items.get("_step"), "global_step": items.get("train/global_step"),
                     "keys": sorted({k.split("/")[0] if k.split("/")[0] in MEDIA else k for k in items})}
            if "tree_view/path" in items:
                entry["page"] = (run_file.parent / "files" / items["tree_view/path"]).read_text(encoding="utf-8")
            rows.append(entry)
    return rows


def _wandb_records(data: bytes) -> list:
    """The protobuf records of a W&B run file (a LevelDB-style log: 32 KiB blocks of chunks, FULL/FIRST/MIDDLE/LAST)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, (ident, magic)
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a record header never straddles a block: the rest is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # the writer is still writing this chunk
            break
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind not in (1, 4):  # FIRST / MIDDLE: the record goes on in the next block
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        records.append(record)
    return records


if __name__ == "__main__":
    trainer = train()
    report = {"pages": sorted(p.name for p in (OUT / "tree_view").glob("*step_*.json")),
              "global_step": trainer.state.global_step}
    if "trackio" in TRACKERS:
        report["trackio"] = trackio_rows()
    if "wandb" in TRACKERS:
        import wandb

        if wandb.run is not None:
            wandb.finish()
        report["wandb"] = wandb_rows()
    (OUT / "report.json").write_text(json.dumps(report))
