"""`trl-tree at2po`: a HotpotQA search agent trained with AT2PO (entropy-guided expansion, child-softmax turn credit,
the ATPO loss; see `trl_tree.scripts.hotpot`)."""

from trl_tree.scripts.hotpot import run

__all__ = ["run"]

if __name__ == "__main__":
    run("at2po", prog="trl-tree at2po")
