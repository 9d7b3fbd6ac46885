"""The base layer: error types, small tensor helpers, where conf/, csrc/ and the cache are, safe file opens,
free disk space and host memory, the component registry and the batch type. Imports nothing else of the framework."""
