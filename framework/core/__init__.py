"""The base layer: error types, small tensor helpers, where conf/ and csrc/ are, safe file opens,
free-space claims, the component registry and the batch type. Imports nothing else of the framework."""
