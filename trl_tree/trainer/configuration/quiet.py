"""Deprecation warnings about TRL's own code, which a user of trl-tree can do nothing about, kept off the console.

transformers 5.23 renamed `gradient_checkpointing` to `activation_checkpointing` (and the model methods with it). TRL
1.16 still uses the old names: GRPOConfig's default `gradient_checkpointing=True` warns when any config is built, and
TRL's `unwrap_model_for_generation` calls `gradient_checkpointing_disable()` / `_enable()` around every generation, so
the README's two-step example printed 10 FutureWarnings that named neither the user's code nor anything to change.
The training script avoids them by setting the new name (`activation_checkpointing` in its recipe); here the same is
done for configs built in Python. A user who sets the old name to something other than GRPO's default still sees the
warning: that one is about their code.
"""

from __future__ import annotations

import contextlib
import warnings

# what transformers says when TRL's code (or GRPOConfig's default) uses the old names
_OLD_CHECKPOINTING_NAMES = r"`(is_)?gradient_checkpointing(_enable|_disable|_kwargs)?` is deprecated"


@contextlib.contextmanager
def without_trl_default_checkpointing_warning(config):
    """Around `GRPOConfig.__post_init__`: no FutureWarning for `gradient_checkpointing` when it holds GRPOConfig's
    default (True) and the new name is unset, i.e. when the user set neither (the value is the same either way)."""
    default = config.gradient_checkpointing is True and getattr(config, "activation_checkpointing", None) is None
    with warnings.catch_warnings():
        if default:
            warnings.filterwarnings("ignore", message="`gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


@contextlib.contextmanager
def without_trl_checkpointing_warnings():
    """Around TRL's `unwrap_model_for_generation`: its `is_gradient_checkpointing` read and its
    `gradient_checkpointing_disable()` / `_enable()` calls, once per generation."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_OLD_CHECKPOINTING_NAMES, category=FutureWarning)
        yield
