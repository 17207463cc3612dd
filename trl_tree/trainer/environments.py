"""The tree trainers' environments (`environment_factory=`): their pool, resets and tools (docs/design.md §2).

A mixin of `TreeTrainer`. GRPOTrainer creates a pool of environment instances and resets one per completion inside
the generation step the tree trainers replace; a tree needs more than that: one environment per prompt at its root,
forked or replayed for the other trajectories and branches (`trl_tree.rollout.env_branching`). This module connects the two:
it wraps GRPOTrainer's pool (reached through `trl_internals`) in the rollout layer's `EnvironmentPool`, resets one
`TreeEnvironment` per prompt at each batch (its `reset()` text appended to the prompt, as GRPOTrainer does), and gives
each tree's root its tools. Its own file so that the trainer module is the adapter from GRPOTrainer to the pipeline
only.
"""

from __future__ import annotations

from trl.data_utils import is_conversational

from .. import trl_internals
from ..rollout.env_branching import EnvironmentPool, TreeEnvironment, environment_tools


class EnvironmentHandling:
    """The environment pool, resets and tools; mixed into `TreeTrainer` (reads its args, `environment_factories`,
    tools and turn loop)."""

    def _hide_fork_from_tools(self):
        """An environment's `fork()` is how we branch it, not a tool for the model."""
        if self.environment_factories is None:
            return
        env_tools = trl_internals.environment_tools_by_name(self)
        for name, tools in env_tools.items():
            env_tools[name] = [t for t in tools if getattr(t, "__name__", "") != "fork"]
        self.tools = [t for t in self.tools if getattr(t, "__name__", "") != "fork"]

    def _build_environment_pool(self) -> EnvironmentPool | None:
        """GRPOTrainer's pool (its probe instances included), grown when trees need more instances, and the
        `environment_branching` rule."""
        if self.environment_factories is None:
            return None
        pool = trl_internals.environment_pool(self)
        return EnvironmentPool(
            self.environment_factories, pool, self.args.environment_branching, self.args.replay_divergence
        )

    def _reset_environments(self, inputs: list[dict], prompts: list) -> tuple[list, list]:
        """One environment per row, reset with the row's columns: (environments, their `TreeEnvironment` handles),
        None each without `environment_factory`. A reset's text observation is appended to its conversational prompt's
        last message (in place in `prompts`), as GRPOTrainer does.

        Environments come from the pool: the previous batch's instances are free again here (as GRPOTrainer reuses
        its pool every batch), and each tree takes more from it for its other trajectories and replayed branches."""
        envs, handles = [None] * len(inputs), [None] * len(inputs)
        if self.environment_factories is None:
            return envs, handles
        multi = trl_internals.multi_environment(self)
        names = [x.get("environment") if multi else None for x in inputs]
        trl_internals.set_batch_environments(self, names)
        self.environment_pool.release()
        for i, (x, name) in enumerate(zip(inputs, names)):
            if name not in self.environment_factories:
                raise ValueError(
                    f"Example has environment={name!r}, not among {list(self.environment_factories)}."
                )
            kwargs = {k: v for k, v in x.items() if k != "environment"} if multi else x
            handles[i] = TreeEnvironment(self.environment_pool, name, kwargs, self._turn_loop.run_call)
            envs[i] = handles[i].start()
            observation = handles[i].reset_observation
            if isinstance(observation, str) and is_conversational({"prompt": prompts[i]}):
                last = prompts[i][-1]
                prompts[i] = prompts[i][:-1] + [{**last, "content": last["content"] + observation}]
        return envs, handles

    def _root_tools(self, env) -> dict:
        """A tree's tools by name: those passed with `tools=`, and its environment's (None: no environment)."""
        tools = {t.__name__: t for t in trl_internals.standalone_tools(self)}
        if env is not None:
            tools.update({m.__name__: m for m in environment_tools(env)})
        return tools
