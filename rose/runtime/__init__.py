"""The runtime: Ray actors and the `rose train` driver loop."""
