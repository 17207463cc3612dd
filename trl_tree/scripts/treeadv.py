"""`trl-tree treeadv`: a HotpotQA search agent trained with TreeAdv (branching inside turns at high-entropy tokens,
segment advantages, GRPO's clipped surrogate; see `trl_tree.scripts.hotpot`)."""

from trl_tree.scripts.hotpot import run

__all__ = ["run"]

if __name__ == "__main__":
    run("treeadv", prog="trl-tree treeadv")
