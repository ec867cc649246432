"""DeepSpeed adapter for dAD (DeepSpeedAggregator, engine hook): coming in a later release."""
