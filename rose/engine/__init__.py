"""Native generation engine."""
