"""`trl-tree <method>`'s training script, one for every method of the table: `train.py METHOD [options]`.

`accelerate launch` runs this file with the method's name first, then the script's options; which script form
trains it (the generic one or the HotpotQA example) is `trl_tree.scripts.script_for`'s rule. One entry for all
methods, so registering a `Method` (`trl_tree.methods.register_method`) makes its command runnable, with no file to
add here.
"""

import sys

from trl_tree import methods
from trl_tree.scripts import run


def main(argv: list[str] | None = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in methods.METHODS:
        raise SystemExit(f"usage: train.py METHOD [OPTIONS], METHOD one of {', '.join(methods.METHODS)}")
    method, *options = argv
    return run(method, options, prog=f"trl-tree {method}")


if __name__ == "__main__":
    main()
