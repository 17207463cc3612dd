"""`trl-tree treeopsd`: a HotpotQA search agent trained with TreeOPSD (see `trl_tree.scripts.hotpot`)."""

from trl_tree.scripts.hotpot import run

__all__ = ["run"]

if __name__ == "__main__":
    run("treeopsd", prog="trl-tree treeopsd")
