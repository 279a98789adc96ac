"""DVC pipeline stages and run comparison."""
