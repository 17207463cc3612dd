"""Training scripts behind `examples/` and the `trl-tree` console command (one module per command, as `trl/scripts`)."""
