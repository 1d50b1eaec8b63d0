"""The algorithms over slots: reducing collectives, data movement, one-phase kernels."""
