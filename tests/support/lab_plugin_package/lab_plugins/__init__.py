"""A lab's extensions of espnet3-flows, registered by entry points (see ``pyproject.toml``)."""
