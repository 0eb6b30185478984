"""Tools that may import both services: the process launcher, the demo, builders that need the model."""
