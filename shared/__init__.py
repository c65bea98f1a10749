"""Code that the api, the worker and the scheduler all need."""
