"""`trl-tree treepo`: train with TreePO (TreeOPSD's trees and credit, the fixed-credit loss).

Any dataset with rewards and tools by import path, or the HotpotQA search agent (see `trl_tree.scripts`)."""

from trl_tree.scripts import run

__all__ = ["run"]

if __name__ == "__main__":
    run("treepo", prog="trl-tree treepo")
