"""`trl-tree treeopsd`: a HotpotQA search agent trained with TreeOPSD (see `trl_tree.scripts.hotpot`)."""

from trl_tree.scripts.hotpot import make_parser, run

__all__ = ["make_parser", "run"]

if __name__ == "__main__":
    run("treeopsd", prog="trl-tree treeopsd")
