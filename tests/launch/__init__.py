"""Scripts that `accelerate launch` runs in several processes (`-m tests.launch.NAME` from the repository root when they
import the suite's helpers); the tests in `tests/` start them and check their reports."""
