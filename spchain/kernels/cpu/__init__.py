"""``@njit(cache=True)`` CPU kernels: raw arrays in, preallocated outputs filled."""
