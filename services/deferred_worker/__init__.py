"""Ray deferred workers: turn-boundary recovery on other processes or machines (docs/mechanism.md §8)."""
