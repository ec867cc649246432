"""Horovod adapter for dAD (HorovodAggregator, DADOptimizer): coming in a later release."""
