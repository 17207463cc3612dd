"""The core: the one-way flow from a grown unit to its loss, with no TRL and no rollout (docs/design.md §2).

    tree.py            RolloutTree, Turn: the data model
    credit.py          per-turn credit, pure functions citing their equations
    batch.py           the typed credit (TurnCredit and its kinds) and a micro-batch flattened for the losses
    packing.py         units -> packed rows (positions, ancestor masks, gather indices) and their forward
    tree_attention.py  tree_sdpa, the attention that computes only a tree row's visible pairs
    losses.py          pure functions on per-token tensors
    pipeline.py        Algorithm 1 without TRL: grow, score, π_old, credit, pack (through ports)
    tree_unit.py       the rollout tree as the pipeline's unit
    flex_unit.py       TreeFlex's group of complete searches as the pipeline's unit

What it may import: the standard library, torch and transformers (tree attention registers itself with
transformers' attention interfaces), and itself. Never TRL, `trl_tree.rollout`, `trl_tree.methods` or
`trl_tree.trainer`: what a unit or the pipeline needs of them (a sampler, a harness, a rollout session, the reward
functions, the configured credit) comes in through its constructor or `pipeline.PipelinePorts`
(tests/test_layers.py holds it to that). Nothing is imported here, so `import trl_tree.core.credit` stays light;
`packing` and `tree_attention` import transformers.
"""
