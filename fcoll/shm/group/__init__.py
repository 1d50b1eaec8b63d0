"""The c10d surface: the process group, its argument checks and fast paths, the direct path."""
