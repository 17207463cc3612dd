"""Acting: what happens between two turns, when the policy calls a tool (docs/design.md §5).

It owns one tool call (`tools`: argument checks, deadline, errors, the tool message, all untrusted input), many calls
at once (`tool_executor`: a bounded pool, batched tools, calls in flight during generation), stateful environments
(`env_branching`: the pool, snapshots, fork / copy / replay of a branch's world) and the special-token guard on
observations (`special_tokens`). A new tool feature goes here. It may import `trl_tree.text` and the core; nothing
of growing or generating (they call it), and never the trainer.
"""
