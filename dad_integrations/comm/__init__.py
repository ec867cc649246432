"""Communication: the `FactorAggregator` interface the algorithms talk to, the torch.distributed
aggregator, process groups, and the byte counter. Imports nothing else of the package."""
