"""`trl-tree treepo`: a HotpotQA search agent trained with TreePO, TreeOPSD's fixed-credit control."""

from trl_tree.scripts.hotpot import run

__all__ = ["run"]

if __name__ == "__main__":
    run("treepo", prog="trl-tree treepo")
