"""trl-tree's test suite, a package so that its shared helpers (`tests.scripted`, `tests.trees`, `tests.remote_env`)
and the launch scripts under `tests/launch` are imported by name, with no change to `sys.path`."""
