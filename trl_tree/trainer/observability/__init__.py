"""What the tree trainers show: metrics reduced over ranks, generation logs under GRPOTrainer's names, the
console's completions table, the tree-view pages' trainer side and the model card.

`rank_metrics` holds the reductions every rank must call in step; `generation_logging` logs one generation batch as
GRPOTrainer would; `completions_table` and `tree_view_logging` show the trees; `model_card` writes what trained the
model. A new metric or view element goes here. It reads the trainer's results as values and imports neither the
adapter nor the presets; nothing here trains or generates.
"""
