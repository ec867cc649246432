"""The exchange: the ordered per-step exchanger of DDP, Horovod and plain torch.distributed
(`exchanger`) with its route policy (`policy`), the step window and worker, the first-step checks;
and the sharded exchanger FSDP2 and ZeRO share (`sharded`), with its two shard layouts: row blocks
(`row_shards`, FSDP2's ``Shard(0)``) and flat element ranges (`partitions`, ZeRO's)."""
