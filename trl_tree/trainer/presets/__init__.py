"""The named methods' trainers: each a `TreeTrainer` preset of one method's sampler, credit and loss.

One file a method (`treeopsd`, `treepo`, `at2po`, `treeadv`; `treeflex`, which also swaps the unit for TreeFlex's
group of searches). A preset is a class name, its paper and its defaults; what it trains is declared in the method
table (`trl_tree.methods`), which names these classes. A new method's trainer goes here. May import the trainer's
adapter (`..base`) and its configuration; nothing here is imported by the adapter.
"""
