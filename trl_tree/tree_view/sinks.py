"""Where a page goes besides its file: the trackers that take HTML, one class per tracker behind a small protocol
(`TrackerSink`), registered by the name `report_to` uses. Adding a tracker is one class and one `register_sink`;
the trainer (`trainer/observability/tree_view_logging.py`) knows only `log_page_to_trackers` and `sinks_for`.

Each sink logs the page under `TRACKER_KEY` at the trainer's global step and, through `filed_at`, files the other
logs of one `TreeTrainer.log` call there too (transformers' callbacks and TRL's completions table log without a
step). The page goes in as a file-like object, so a tracker never mistakes it for a path, and without the tracker's
injected stylesheet (it is self-contained)."""

from __future__ import annotations

import contextlib
import importlib
import io
import sys
from collections.abc import Callable, Iterator
from typing import Protocol

TRACKER_KEY = "tree_view"
GLOBAL_STEP = "train/global_step"  # transformers' W&B callback: the step metric of every logged key ("*")


class TrackerSink(Protocol):
    """A tracker the page can go to."""

    name: str  # as in `report_to`

    def log_page(self, page: str, *, step: int, caption: str | None = None) -> bool:
        """Log the page's HTML at the trainer's global `step`; False when the tracker cannot take it now (not
        installed, no active run, a release without an HTML type)."""

    def filed_at(self, current_step: Callable[[], int]) -> contextlib.AbstractContextManager:
        """A context inside which every log to this tracker that names no step is filed at `current_step()`."""


SINKS: dict[str, type] = {}


def register_sink(cls: type) -> type:
    """Register a sink class under its `name`; a name registered twice is refused."""
    if cls.name in SINKS:
        raise ValueError(f"tracker sink {cls.name!r} is registered already ({SINKS[cls.name].__qualname__}).")
    SINKS[cls.name] = cls
    return cls


def _names(report_to) -> list[str]:
    return [report_to] if isinstance(report_to, str) else list(report_to or [])


def sinks_for(report_to) -> list[TrackerSink]:
    """The sinks of the trackers `report_to` names (a name with no sink, e.g. tensorboard, takes no page)."""
    return [SINKS[name]() for name in _names(report_to) if name in SINKS]


def log_page_to_trackers(page: str, report_to, *, step: int, caption: str | None = None) -> list[str]:
    """Log the page under `tree_view` at the trainer's global `step` to each tracker in `report_to` that takes HTML
    (`caption`: where the full page is saved); returns the names of the trackers logged to."""
    return [sink.name for sink in sinks_for(report_to) if sink.log_page(page, step=step, caption=caption)]


def _module(name: str, *, import_it: bool = True):
    if name in sys.modules:
        return sys.modules[name]
    if not import_it:
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


@contextlib.contextmanager
def _wrapped_log(module, wrap) -> Iterator[None]:
    """`module.log` replaced by `wrap(module.log)` inside (trackers' callers look `log` up at call time), put back
    after, also on an error."""
    original = module.log
    module.log = wrap(original)
    try:
        yield
    finally:
        module.log = original


@register_sink
class WandbSink:
    """W&B: `wandb.Html` when `wandb` is importable and a run is active (as GRPOTrainer checks `wandb.run` for its
    table), in a row with `train/global_step` = the step, the axis transformers' W&B callback plots every metric
    against (W&B's own history step cannot be set: it must only grow, and the scalars' rows already moved it on)."""

    name = "wandb"

    def log_page(self, page: str, *, step: int, caption: str | None = None) -> bool:
        wandb = _module("wandb")
        if wandb is None or getattr(wandb, "run", None) is None:
            return False
        wandb.log({TRACKER_KEY: wandb.Html(io.StringIO(page), inject=False), GLOBAL_STEP: step})
        return True

    def active(self) -> bool:
        wandb = _module("wandb", import_it=False)
        return wandb is not None and getattr(wandb, "run", None) is not None and callable(getattr(wandb, "log", None))

    def filed_at(self, current_step: Callable[[], int]) -> contextlib.AbstractContextManager:
        if not self.active():
            return contextlib.nullcontext()

        def wrap(log):
            def log_with_step(data, *args, **kwargs):
                if isinstance(data, dict) and GLOBAL_STEP not in data:
                    data = {**data, GLOBAL_STEP: current_step()}
                return log(data, *args, **kwargs)

            return log_with_step

        return _wrapped_log(sys.modules["wandb"], wrap)


@register_sink
class TrackioSink:
    """Trackio: `trackio.Html` where the installed Trackio has it (without it the saved file is the page), at
    `step=step`, with the caption (a Trackio release whose `Html` takes no caption gets none)."""

    name = "trackio"

    def log_page(self, page: str, *, step: int, caption: str | None = None) -> bool:
        trackio = _module("trackio")
        html_type = getattr(trackio, "Html", None)
        if html_type is None:
            return False
        try:
            value = html_type(io.StringIO(page), inject=False, caption=caption)
        except TypeError:  # a Trackio release whose Html takes no caption
            value = html_type(io.StringIO(page), inject=False)
        trackio.log({TRACKER_KEY: value}, step=step)
        return True

    def filed_at(self, current_step: Callable[[], int]) -> contextlib.AbstractContextManager:
        trackio = _module("trackio", import_it=False)
        if trackio is None or not callable(getattr(trackio, "log", None)):
            return contextlib.nullcontext()

        def wrap(log):
            def log_at_step(metrics, step=None, **kwargs):
                return log(metrics, step=current_step() if step is None else step, **kwargs)

            return log_at_step

        return _wrapped_log(trackio, wrap)
