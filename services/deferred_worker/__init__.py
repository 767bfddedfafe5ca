"""Ray deferred workers: turn-boundary recovery on other processes or machines (MECHANISM.md §8)."""
