"""The graph: what a tensor program is before it runs — element types (dtypes), views and shape
trackers (shape), lazy nodes and their ops (lazy). Imports only base; codegen, the scheduler and
everything above read it."""
