"""msd-train: train, check and ship MSD draft heads for multimodal LLMs."""

__version__ = "0.1.0"
