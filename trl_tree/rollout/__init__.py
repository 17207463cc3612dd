"""The rollout layer, by job (docs/design.md §2): `growing/` (samplers, the turn loop, expansion, TreeFlex's harness),
`generating/` (the engines and the prefix store) and `acting/` (tools, the executor, environment branching, special
tokens). Growing calls the other two; they call nothing of it. The old flat paths (`trl_tree.rollout.engine`, ...)
still import for one release, with a DeprecationWarning naming the new one.
"""
