"""The GPU session (``session``): what one lent device call runs, in which order, within its
budget, and what comes back (``docs/gpu.md``)."""
