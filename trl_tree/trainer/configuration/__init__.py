"""The tree trainers' configurations: `GRPOConfig` subclasses and the rules their fields obey.

`fields` is the documented list of options (what `--help` and `TrlParser` show); `checks` the rules a value must obey
and the errors a wrong one raises; `resolution` how G, the sampler's budget and GRPO's batch layout determine each
other; `tree_budget` what a configuration costs (trajectories, leaves) and the sizes refused up front; `quiet` the
TRL deprecation warnings a config raises that no user can act on. A new option goes in `fields` with its check in
`checks`. Imports the method table and the rollout layer's value checks, never the trainer's adapter, its
observability or the presets.
"""
