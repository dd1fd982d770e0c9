"""Performance measurements from RTL simulation (scripts, not CI tests)."""
