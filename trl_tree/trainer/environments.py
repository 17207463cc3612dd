"""The tree trainers' environments (`environment_factory=`): their pool, resets and tools (docs/design.md §2).

A collaborator of `TreeTrainer` (`RootEnvironments`, built with what it reads). GRPOTrainer creates a pool of environment instances and resets one per completion inside
the generation step the tree trainers replace; a tree needs more than that: one environment per prompt at its root,
forked or replayed for the other trajectories and branches (`trl_tree.rollout.acting.env_branching`). This module connects the two:
it wraps GRPOTrainer's pool (reached through `trl_internals`) in the rollout layer's `EnvironmentPool`, resets one
`TreeEnvironment` per prompt at each batch (its `reset()` text appended to the prompt, as GRPOTrainer does), and gives
each tree's root its tools. Its own file so that the trainer module is the adapter from GRPOTrainer to the pipeline
only.
"""

from __future__ import annotations

from trl.data_utils import is_conversational

from ..rollout.acting.env_branching import EnvironmentPool, TreeEnvironment, environment_tools


def hide_fork(tools: list, env_tools: dict | None) -> list:
    """An environment's `fork()` is how we branch it, not a tool for the model: dropped from `env_tools` (in place,
    GRPOTrainer's tools per environment) and from `tools` (returned)."""
    for name, by_name in (env_tools or {}).items():
        env_tools[name] = [t for t in by_name if getattr(t, "__name__", "") != "fork"]
    return [t for t in tools if getattr(t, "__name__", "") != "fork"]


class RootEnvironments:
    """The environment pool, resets and a root's tools; held by `TreeTrainer` as `root_environments`.

    `factories` are GRPOTrainer's `environment_factories` (None: no environments), `instances` its pool of
    instances, `branching` / `divergence` the `environment_branching` and `replay_divergence` rules, `run_call` the
    turn loop's tool call, `standalone_tools` the tools passed with `tools=`, `multi` whether rows name their
    environment, `note_batch` what receives each batch's environment names (GRPOTrainer's `_batch_environments`)."""

    def __init__(self, *, factories: dict | None, instances, branching: str, divergence: str, run_call,
                 standalone_tools: list, multi: bool, note_batch):
        self.factories = factories
        # GRPOTrainer's pool (its probe instances included), grown when trees need more instances
        self.pool = None if factories is None else EnvironmentPool(factories, instances, branching, divergence)
        self._run_call = run_call
        self._tools_passed = standalone_tools
        self._multi = multi
        self._note_batch = note_batch

    def reset(self, inputs: list[dict], prompts: list) -> tuple[list, list]:
        """One environment per row, reset with the row's columns: (environments, their `TreeEnvironment` handles),
        None each without `environment_factory`. A reset's text observation is appended to its conversational prompt's
        last message (in place in `prompts`), as GRPOTrainer does.

        Environments come from the pool: the previous batch's instances are free again here (as GRPOTrainer reuses
        its pool every batch), and each tree takes more from it for its other trajectories and replayed branches."""
        envs, handles = [None] * len(inputs), [None] * len(inputs)
        if self.factories is None:
            return envs, handles
        multi = self._multi
        names = [x.get("environment") if multi else None for x in inputs]
        self._note_batch(names)
        self.pool.release()
        for i, (x, name) in enumerate(zip(inputs, names)):
            if name not in self.factories:
                raise ValueError(
                    f"Example has environment={name!r}, not among {list(self.factories)}."
                )
            kwargs = {k: v for k, v in x.items() if k != "environment"} if multi else x
            handles[i] = TreeEnvironment(self.pool, name, kwargs, self._run_call)
            envs[i] = handles[i].start()
            observation = handles[i].reset_observation
            if isinstance(observation, str) and is_conversational({"prompt": prompts[i]}):
                last = prompts[i][-1]
                prompts[i] = prompts[i][:-1] + [{**last, "content": last["content"] + observation}]
        return envs, handles

    def root_tools(self, env) -> dict:
        """A tree's tools by name: those passed with `tools=`, and its environment's (None: no environment)."""
        tools = {t.__name__: t for t in self._tools_passed}
        if env is not None:
            tools.update({m.__name__: m for m in environment_tools(env)})
        return tools
