"""Growing trees: where a unit's trajectories start, branch and continue (docs/design.md §2, §5).

It owns the samplers (`samplers`: InitExpand, EntropyGuided; `token_branching`: branching inside a turn), the turn
loop that advances every ready branch by one turn (`turn_loop`: Branch, TurnLoop and its one port, `TurnLoopPorts`),
AT2PO's choice of which turns to branch from next (`expansion`) and TreeFlex's harness of complete searches
(`flex_harness`). A new sampler or search strategy goes here. It may import `generating` (what continues a prefix),
`acting` (tools and environments), the core (the tree it builds) and `trl_tree.text`; never the trainer, the method
table that builds it, or TRL's private names.
"""
