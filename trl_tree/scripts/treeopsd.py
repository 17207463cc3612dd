"""`trl-tree treeopsd`: train with TreeOPSD (tree rollouts, turn-level Bernoulli forward-KL).

Any dataset with rewards and tools by import path, or the HotpotQA search agent (see `trl_tree.scripts`)."""

from trl_tree.scripts import run

__all__ = ["run"]

if __name__ == "__main__":
    run("treeopsd", prog="trl-tree treeopsd")
