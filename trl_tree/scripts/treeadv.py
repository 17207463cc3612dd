"""`trl-tree treeadv`: train with TreeAdv (branching inside turns at high-entropy tokens,
segment advantages, GRPO's clipped surrogate).

Any dataset with rewards and tools by import path, or the HotpotQA search agent (see `trl_tree.scripts`)."""

from trl_tree.scripts import run

__all__ = ["run"]

if __name__ == "__main__":
    run("treeadv", prog="trl-tree treeadv")
