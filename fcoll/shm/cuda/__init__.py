"""CUDA tensors on fcoll groups: the staged and IPC paths and their submission."""
