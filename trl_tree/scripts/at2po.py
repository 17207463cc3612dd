"""`trl-tree at2po`: train with AT2PO (entropy-guided expansion, child-softmax turn credit,
the ATPO loss).

Any dataset with rewards and tools by import path, or the HotpotQA search agent (see `trl_tree.scripts`)."""

from trl_tree.scripts import run

__all__ = ["run"]

if __name__ == "__main__":
    run("at2po", prog="trl-tree at2po")
